"""Crash-safe checkpoints of a Trainer: one complete directory per saved step, verified on load.

Layout of a checkpoint root `DIR`:

    DIR/step-000042/config.json, model.safetensors   a Hugging Face checkpoint (--model, transformers)
    DIR/step-000042/optimizer.safetensors            AdamW's per-parameter tensors
                                                     (both: Hugging Face's shards plus their
                                                     *.index.json beyond 2 GiB, written at once)
    DIR/step-000042/trainer.json                     counters, input position, AdamW's param groups,
                                                     the run's fingerprint
    DIR/step-000042/tokenizer.json, ...              the source model's tokenizer files, chat
                                                     template and generation config, when present
    DIR/step-000042/manifest.json                    size and sha256 of every file above
    DIR/latest.txt                                   the name of the newest complete step directory
    DIR/latest -> step-000042                        a relative symlink to it (from_pretrained,
                                                     inference engines); a text file like
                                                     latest.txt where symlinks are refused

A step directory is written under a temporary name, fsynced and renamed into
place (treeflow.atomic), then the `latest` symlink and last `latest.txt` are
moved to it -- the commit, read on resume (older checkpoints' `latest` text
file still is) -- and
only then are directories beyond the last `keep` removed: a kill at any
instant leaves the previous complete checkpoint intact. Loading takes the
step `latest` names, or when its manifest does not verify the newest older
one that does, and says which it skipped and why; a torn or corrupted
checkpoint can therefore never be resumed silently.

Data-parallel runs (several ranks) write the same layout: the step directory
holds `dcp/` (torch.distributed.checkpoint shards of the model and AdamW,
train/sharded.py, written by every rank into rank 0's temporary directory)
instead of `optimizer.safetensors`, and rank 0 alone writes the manifest,
renames and moves `latest`. Either kind resumes on any number of ranks.

Nothing is unpickled: weights and optimizer tensors are safetensors, the rest
is JSON, and a `dcp/` checkpoint's pickled index and non-tensor items are read by
train/dcp_safe.py, which builds only DCP's metadata classes and plain values, so a
checkpoint from someone else cannot run code. A step directory verifies only when
it holds exactly the files its manifest lists (a file planted beside them is named
and refused), and a directory without a manifest (an older treeflow's, or a bare
DCP directory) cannot be verified: it is refused unless the caller says it trusts
it (`--trust-checkpoint`, `trust_checkpoint=True`). The price is that
only optimizers whose state is tensors and plain numbers can be saved (AdamW's
is). Hashing every file on load costs one read of the checkpoint (about a
second per GB).

This module writes; train/checkpoint_load.py finds, verifies and loads (its names are
re-exported here, so `treeflow.train.checkpoint` stays the one import for both), and
train/checkpoint_layout.py holds the names and records both read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from treeflow.atomic import (atomic_dir, atomic_open, check_output, commit_dir, named, remove,
                              remove_stale, temp_name)
from treeflow.tensorfile import in_parallel, write_sharded
from treeflow.train.checkpoint_layout import (CONFIG_JSON, FORMAT, LATEST, LATEST_RECORD,  # noqa: F401
                                              LEGACY_STATE, MANIFEST, MODEL_FILES, OPTIMIZER,
                                              OPTIMIZER_STEM,
                                              TRAINER_JSON, latest_step, layout_of, sha256_of,
                                              note_stderr, step_dirs, tensor_parallel_of, writers_of,
                                              step_dir_name)
from treeflow.train.checkpoint_load import (find_checkpoint, latest_step_dir,  # noqa: F401
                                            load_checkpoint, model_dir, verify)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):  # on its device: copied to the host when written, one by one
                tensors[f"state.{idx}.{k}"] = v.detach()
            elif isinstance(v, (int, float, bool)) or v is None:
                scalars[f"{idx}.{k}"] = v
            else:
                raise TypeError(f"optimizer state {k!r} of type {type(v).__name__} cannot be "
                                "stored without pickle")
    return tensors, [sd["param_groups"], scalars]


def save_checkpoint(trainer, root: str | os.PathLike, *, keep: int | None = None) -> str:
    """Write a complete step directory under `root`, point `latest` at it, prune; return its path.

    Every data-parallel rank calls it (all write the sharded state; rank 0 commits).
    """
    if writers_of(trainer)[0]:
        return _sharded_writer(trainer, root, keep, background=False)()
    return checkpoint_writer(trainer, root, keep=keep)()


def checkpoint_writer(trainer, root: str | os.PathLike, *, keep: int | None = None,
                      snapshot: bool = False) -> Callable[[], str] | None:
    """Capture the step's counters now; return the function that writes, commits and prunes.

    The returned function reads the model's and AdamW's tensors when it runs, one at a
    time (treeflow/tensorfile.py; DCP's writer for sharded checkpoints), so it may run in a
    background thread while the next step computes -- as long as it finishes before the
    next optimizer step changes them (train/background_save.py holds that fence). Where
    several processes write together every one of them calls this, and the collectives
    that need the training group run now (train/sharded.py's `sharded_writer`); None where
    the write itself needs them (tensor parallelism, a backend with its own DCP layout).

    snapshot (one process, a backend with `snapshot_state`): clone the weights and AdamW
    tensors now, on their device, so that the write reads the clones and the next optimizer
    step need not wait for it (`write.detached` is then True). Device memory for as long as
    the write runs: one more copy of the weights and the optimizer state; host memory: one
    tensor at a time, as without it.
    """
    distributed, _, _ = writers_of(trainer)
    if distributed:
        if not _can_write_in_background(trainer):
            return None
        return _sharded_writer(trainer, root, keep, background=True)
    root, name, final, state = _begin(trainer, root, keep)
    source = _source_model(trainer)
    config = getattr(trainer, "config", None)
    tensors, (groups, scalars) = _optimizer_tensors(trainer.optimizer)
    state["optimizer"] = {"param_groups": groups, "scalars": scalars}
    take = getattr(trainer.backend, "snapshot_state", None) if snapshot else None
    save_weights = trainer.backend.save
    if take is not None:
        with torch.no_grad():
            save_weights = take()  # the weights' clones and the function that writes them
            tensors = {k: v.clone() for k, v in tensors.items()}

    def write() -> str:
        os.makedirs(root, exist_ok=True)
        remove_stale(root)
        with atomic_dir(final) as tmp:
            # the weights and AdamW at once, each in shards written at once where it is large
            # (treeflow/tensorfile.py): bound by the disk, not by one sha256 stream per file
            in_parallel(lambda: save_weights(tmp),
                        lambda: write_sharded(tmp, OPTIMIZER_STEM, sorted(tensors.items()),
                                              metadata={"format": "pt"}))
            copy_model_files(source, tmp)
            _write_config(tmp, config)
            _write_state_and_manifest(tmp, state)
        _commit_latest(root, name, keep)
        return final

    write.detached = take is not None
    return write


def _sharded_writer(trainer, root, keep, *, background: bool) -> Callable[[], str]:
    """Every rank: agree on rank 0's temporary directory now; return the write of the shards
    into it, then (rank 0) the manifest, the rename and the `latest` commit.

    background: the write's collectives (DCP's planning, the barriers) run on a gloo group
    made for checkpoints (one per trainer), never on the training group, whose collectives
    the next step runs meanwhile from the main thread.
    """
    import torch.distributed as dist

    from treeflow.train.collectives import broadcast
    from treeflow.train.sharded import sharded_writer

    _, lead, group = writers_of(trainer)
    root, name, final, state = _begin(trainer, root, keep)
    box = [None]
    if lead:
        os.makedirs(root, exist_ok=True)
        remove_stale(root)
        box[0] = temp_name(final)
        os.mkdir(box[0])
    tmp = broadcast(box[0], src=0, group=group)  # a path, as JSON: no pickle between ranks
    try:
        shards = sharded_writer(trainer, state, TRAINER_JSON, lead=lead, group=group,
                                background=background)
    except BaseException:
        if lead:
            remove(tmp)
        raise
    own = _save_group(trainer) if background else None
    source, config = _source_model(trainer), getattr(trainer, "config", None)

    def write() -> str:
        try:
            shards(tmp, own)  # ends with a barrier
            if lead:
                copy_model_files(source, tmp)
                _write_config(tmp, config)
                _write_state_and_manifest(tmp, state)
                commit_dir(tmp, final)
        except BaseException:
            if lead:
                remove(tmp)
            raise
        if lead:
            _commit_latest(root, name, keep)
        dist.barrier(group=own if own is not None else group)  # every rank ends after the commit
        return final

    return write


def _can_write_in_background(trainer) -> bool:
    """Sharded saves whose write needs no collective of the training group: the reference
    backend (no tensor parallelism, no backend DCP layout) on a group that is the whole world
    (so that every process can make the checkpoint group)."""
    import torch.distributed as dist

    backend = trainer.backend
    return (tensor_parallel_of(trainer) == 1 and getattr(backend, "checkpoint_layout", None) is None
            and dist.get_world_size() == trainer.dp.world)


def _save_group(trainer):
    """The checkpoint writes' own gloo group, made once per trainer (every rank makes it)."""
    group = getattr(trainer, "_save_group", None)
    if group is None:
        import torch.distributed as dist

        group = trainer._save_group = dist.new_group(backend="gloo")
    return group


def _begin(trainer, root, keep) -> tuple[str, str, str, dict]:
    """Checks and the counters of the step being saved: (root, step name, its path, state)."""
    root = check_output(root, what="checkpoint directory", directory=True)
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint just written (keep >= 1)")
    name = step_dir_name(trainer.steps)
    state = {"format": FORMAT, "steps": trainer.steps,
             "scheduler_episodes": trainer.scheduler_episodes, "position": trainer.position,
             "run": getattr(trainer, "run", None), "layout": layout_of(trainer)}
    return root, name, os.path.join(root, name), state


def _source_model(trainer) -> str | None:
    """The --model directory the trainer's weights came from (a step directory on resume)."""
    model = getattr(getattr(trainer, "forward_config", None), "model", None)
    return model if isinstance(model, str) and os.path.isdir(model) else None


def copy_model_files(source: str | None, dest: str) -> list[str]:
    """Copy MODEL_FILES present in `source` into `dest` (never over a file written there)."""
    import shutil

    copied = []
    for name in MODEL_FILES if source else ():
        src, dst = os.path.join(source, name), os.path.join(dest, name)
        if os.path.isfile(src) and not os.path.exists(dst):
            shutil.copyfile(src, dst)
            copied.append(name)
    return copied


def _commit_latest(root: str, name: str, keep: int | None) -> None:
    """Point the `latest` symlink at the step just written (a complete directory already), then
    move `latest.txt` to it -- the commit, last, so that a kill before it redoes the step --
    then prune beyond `keep`."""
    _point_latest(root, name)
    with atomic_open(os.path.join(root, LATEST_RECORD)) as f:
        f.write(name + "\n")
    if keep is not None:
        for _, old in step_dirs(root)[keep:]:
            if old != name:
                remove(os.path.join(root, old))


def _point_latest(root: str, name: str) -> None:
    """`latest` -> `name`, a relative symlink renamed into place; a text file where the
    filesystem refuses symlinks."""
    link = os.path.join(root, LATEST)
    if os.path.isdir(link) and not os.path.islink(link):
        if not os.path.isfile(os.path.join(link, MANIFEST)):
            note_stderr(f"{link} is a directory that is not a checkpoint step; left as is "
                    f"({LATEST_RECORD} names {name})")
            return
        remove(link)  # a copy of a step made by a copy that followed the symlink (cp -r)
    tmp = temp_name(link)
    try:
        os.symlink(name, tmp)
        os.replace(tmp, link)
    except OSError:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if os.path.islink(link):
            os.unlink(link)
        with atomic_open(link) as f:
            f.write(name + "\n")


def _write_config(tmp: str, config: dict | None) -> None:
    if config is not None:
        _write_json(os.path.join(tmp, CONFIG_JSON), config, sort_keys=True)


def _write_state_and_manifest(tmp: str, state: dict) -> None:
    _write_json(os.path.join(tmp, TRAINER_JSON), state)
    files = {}
    for d, _, names in os.walk(tmp):
        for n in names:
            p = os.path.join(d, n)
            files[os.path.relpath(p, tmp)] = {"bytes": os.path.getsize(p),
                                              "sha256": sha256_of(p, trust_own_writes=True)}
    _write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "files": dict(sorted(files.items()))})


def _write_json(path: str, obj, *, sort_keys: bool = False) -> None:
    """`obj` as JSON at `path` (inside a step's temporary directory, renamed as a whole); an
    OSError names the file (a full disk raises ENOSPC naming none)."""
    try:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=sort_keys)
    except OSError as e:
        raise named(e, path) from None


__all__ = ["FORMAT", "LATEST", "LATEST_RECORD", "MANIFEST", "MODEL_FILES", "copy_model_files",
           "latest_step_dir", "find_checkpoint", "load_checkpoint", "model_dir",
           "save_checkpoint", "step_dir_name", "verify"]
