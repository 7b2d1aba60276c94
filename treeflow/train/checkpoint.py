"""Crash-safe checkpoints of a Trainer: one complete directory per saved step, verified on load.

Layout of a checkpoint root `DIR`:

    DIR/step-000042/config.json, model.safetensors   a Hugging Face checkpoint (--model, transformers)
    DIR/step-000042/optimizer.safetensors            AdamW's per-parameter tensors
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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import replace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from treeflow.atomic import (atomic_dir, atomic_open, check_output, commit_dir, remove,
                              remove_stale, temp_name)
from treeflow.tensorfile import write_safetensors, written_sha256

LATEST = "latest"
LATEST_RECORD = "latest.txt"
CONFIG_JSON = "config.treeflow.json"  # the resolved command-line options (trainer.config)
# what an inference engine or transformers needs beside config.json + weights, copied from the
# source --model directory into every step directory when present
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
               "spiece.model", "chat_template.jinja", "chat_template.json",
               "generation_config.json", "preprocessor_config.json")
MANIFEST = "manifest.json"
OPTIMIZER = "optimizer.safetensors"
TRAINER_JSON = "trainer.json"
LEGACY_STATE = "trainer_state.pt"
FORMAT = "treeflow-checkpoint/2"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir_name(steps: int) -> str:
    return f"step-{steps:06d}"


def _sha256(path: str, *, trust_own_writes: bool = False) -> str:
    if trust_own_writes:  # a file this process just wrote: hashed while it was written
        known = written_sha256(path)
        if known is not None:
            return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    write = checkpoint_writer(trainer, root, keep=keep)
    if write is not None:
        return write()
    _, lead, group = _writers(trainer)
    root, name, final, state = _begin(trainer, root, keep)
    import torch.distributed as dist

    from treeflow.train.collectives import broadcast
    from treeflow.train.sharded import save_sharded

    box = [None]
    if lead:
        os.makedirs(root, exist_ok=True)
        remove_stale(root)
        box[0] = temp_name(final)
        os.mkdir(box[0])
    tmp = broadcast(box[0], src=0, group=group)  # a path, as JSON: no pickle between ranks
    try:
        save_sharded(trainer, tmp, state, TRAINER_JSON, lead=lead,
                     group=group)  # ends with a barrier
        if lead:
            copy_model_files(_source_model(trainer), tmp)
            _write_config(tmp, getattr(trainer, "config", None))
            _write_state_and_manifest(tmp, state)
            commit_dir(tmp, final)
    except BaseException:
        if lead:
            remove(tmp)
        raise
    if lead:
        _commit_latest(root, name, keep)
    dist.barrier(group=group)  # every rank returns after the commit
    return final


def checkpoint_writer(trainer, root: str | os.PathLike, *,
                      keep: int | None = None) -> Callable[[], str] | None:
    """For a one-process trainer: capture the step's counters now; return the function that
    writes, commits and prunes (None where several processes write together).

    The returned function reads the model's and AdamW's tensors when it runs, one at a
    time (treeflow/tensorfile.py), so it may run in a background thread while the next
    step computes -- as long as it finishes before the next optimizer step changes them
    (train/background_save.py holds that fence).
    """
    distributed, _, _ = _writers(trainer)
    if distributed:
        return None
    root, name, final, state = _begin(trainer, root, keep)
    source = _source_model(trainer)
    config = getattr(trainer, "config", None)
    tensors, (groups, scalars) = _optimizer_tensors(trainer.optimizer)
    state["optimizer"] = {"param_groups": groups, "scalars": scalars}

    def write() -> str:
        os.makedirs(root, exist_ok=True)
        remove_stale(root)
        with atomic_dir(final) as tmp:
            trainer.backend.save(tmp)
            write_safetensors(os.path.join(tmp, OPTIMIZER), sorted(tensors.items()),
                              metadata={"format": "pt"})
            copy_model_files(source, tmp)
            _write_config(tmp, config)
            _write_state_and_manifest(tmp, state)
        _commit_latest(root, name, keep)
        return final

    return write


def _begin(trainer, root, keep) -> tuple[str, str, str, dict]:
    """Checks and the counters of the step being saved: (root, step name, its path, state)."""
    root = check_output(root, what="checkpoint directory", directory=True)
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint just written (keep >= 1)")
    name = step_dir_name(trainer.steps)
    state = {"format": FORMAT, "steps": trainer.steps,
             "scheduler_episodes": trainer.scheduler_episodes, "position": trainer.position,
             "run": getattr(trainer, "run", None), "layout": _layout(trainer)}
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
        for _, old in _step_dirs(root)[keep:]:
            if old != name:
                remove(os.path.join(root, old))


def _point_latest(root: str, name: str) -> None:
    """`latest` -> `name`, a relative symlink renamed into place; a text file where the
    filesystem refuses symlinks."""
    link = os.path.join(root, LATEST)
    if os.path.isdir(link) and not os.path.islink(link):
        if not os.path.isfile(os.path.join(link, MANIFEST)):
            _stderr(f"{link} is a directory that is not a checkpoint step; left as is "
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


def _tensor_parallel(trainer) -> int:
    return getattr(getattr(trainer, "backend", None), "tp", 1)


def _writers(trainer) -> tuple[bool, bool, object]:
    """(distributed, lead, group): the processes that write one checkpoint together.

    Every process that holds a part of the model takes part: the data-parallel ranks, and
    under tensor parallelism every tensor-parallel rank of every replica (the whole world,
    since each holds different shards); the lead (rank 0 of that group) commits.
    """
    dp = getattr(trainer, "dp", None)
    if _tensor_parallel(trainer) > 1:
        import torch.distributed as dist

        return True, dist.get_rank() == 0, dist.group.WORLD
    distributed = dp is not None and dp.distributed
    return distributed, not distributed or dp.rank == 0, dp.group if distributed else None


def _layout(trainer) -> dict:
    """What wrote the checkpoint: backend and parallel sizes (checked and reported on resume)."""
    dp = getattr(trainer, "dp", None)
    return {"backend": getattr(getattr(trainer, "backend", None), "name", None),
            "tensor_parallel": _tensor_parallel(trainer),
            "data_parallel": dp.world if dp is not None else 1}


def _write_config(tmp: str, config: dict | None) -> None:
    if config is not None:
        with open(os.path.join(tmp, CONFIG_JSON), "w") as f:
            json.dump(config, f, indent=1, sort_keys=True)


def _write_state_and_manifest(tmp: str, state: dict) -> None:
    with open(os.path.join(tmp, TRAINER_JSON), "w") as f:
        json.dump(state, f, indent=1)
    files = {}
    for d, _, names in os.walk(tmp):
        for n in names:
            p = os.path.join(d, n)
            files[os.path.relpath(p, tmp)] = {"bytes": os.path.getsize(p),
                                              "sha256": _sha256(p, trust_own_writes=True)}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, "files": dict(sorted(files.items()))}, f, indent=1)


def _step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, name) of the step directories under `root`, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _STEP_DIR.match(n))
             and os.path.isdir(os.path.join(root, n))]
    return sorted(found, reverse=True)


def verify(step_path: str) -> str | None:
    """None when the step directory is complete and unmodified; else what is wrong with it."""
    mpath = os.path.join(step_path, MANIFEST)
    if not os.path.isfile(mpath):
        return f"no {MANIFEST} (the save did not finish)"
    try:
        with open(mpath) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    extra = _unlisted(step_path, files)
    if extra:
        return (f"{', '.join(extra[:3])}{' and more' if len(extra) > 3 else ''} "
                f"{'is' if len(extra) == 1 else 'are'} not in its {MANIFEST} (planted, or left by "
                "another program: nothing outside the manifest is read)")
    for name, want in sorted(files.items()):
        path = os.path.join(step_path, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        size = os.path.getsize(path)
        if size != want["bytes"]:
            return f"{name} has {size} bytes, the manifest says {want['bytes']} (truncated or replaced)"
        if _sha256(path) != want["sha256"]:
            return f"{name} does not match its sha256 in {MANIFEST} (corrupted or modified)"
    return None


def _unlisted(step_path: str, files: dict) -> list[str]:
    """Files (and links to directories) under `step_path` that the manifest does not list."""
    found = []
    for d, dirs, names in os.walk(step_path):
        found += [os.path.relpath(os.path.join(d, n), step_path) for n in dirs
                  if os.path.islink(os.path.join(d, n))]
        found += [os.path.relpath(os.path.join(d, n), step_path) for n in names]
    return sorted(n for n in found if n != MANIFEST and n not in files)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def find_checkpoint(path: str | os.PathLike, *, log: Callable[[str], None] = _stderr,
                    trust_checkpoint: bool = False) -> str:
    """The newest verified step directory of a checkpoint root (or `path` itself if it is one).

    trust_checkpoint: accept a directory without a manifest (it cannot be verified).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such checkpoint directory")
    if not os.path.isdir(path):
        raise ValueError(f"{path}: is a file, not a checkpoint directory")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        problem = verify(path)
        if problem:
            raise ValueError(f"{path}: checkpoint is incomplete or corrupted: {problem}")
        return path
    if os.path.isfile(os.path.join(path, LEGACY_STATE)) or _is_sharded(path):
        if not trust_checkpoint:
            what = LEGACY_STATE if os.path.isfile(os.path.join(path, LEGACY_STATE)) else "dcp/"
            raise ValueError(f"{path}: holds {what} but no {MANIFEST}, so it cannot be verified "
                             "(an older treeflow's checkpoint, or one from elsewhere); resume it "
                             "only if you trust who wrote it, with --trust-checkpoint "
                             "(API: trust_checkpoint=True)")
        return path
    steps = _step_dirs(path)
    if not steps:
        raise ValueError(f"{path}: not a treeflow training checkpoint (no step-NNNNNN directory, "
                         f"no {MANIFEST}); give the directory that --save wrote")
    skipped = []
    committed = _latest_step(path)
    if committed is not None:
        # `latest` is the commit record: a newer directory was renamed into place by a save that
        # was killed before it moved the pointer; the run resumes from what `latest` names
        newer = [name for step, name in steps if step > committed]
        if newer:
            log(f"skipping {', '.join(newer)} in {path}: not committed ({LATEST} names "
                f"{step_dir_name(committed)})")
        steps = [(step, name) for step, name in steps if step <= committed]
        if not steps or steps[0][0] != committed:
            log(f"{os.path.join(path, LATEST)} names {step_dir_name(committed)}, which is missing; "
                "falling back to the previous checkpoint")
    for _, name in steps:
        problem = verify(os.path.join(path, name))
        if problem is None:
            if skipped:
                log(f"resuming from {os.path.join(path, name)} (skipped {', '.join(skipped)})")
            return os.path.join(path, name)
        log(f"skipping checkpoint {os.path.join(path, name)}: {problem}; "
            "falling back to the previous one")
        newest_problem = problem if not skipped else newest_problem
        skipped.append(name)
    raise ValueError(f"{path}: no complete checkpoint: every step directory failed verification "
                     f"({', '.join(skipped)}; the newest: {newest_problem})")


def _latest_step(root: str) -> int | None:
    """The committed step: `latest.txt`, else (older checkpoints) the `latest` text file or
    symlink."""
    for record in (LATEST_RECORD, LATEST):
        path = os.path.join(root, record)
        try:
            if os.path.islink(path):
                text = os.readlink(path)
            else:
                with open(path) as f:
                    text = f.read()
        except OSError:
            continue
        m = _STEP_DIR.match(text.strip())
        return int(m.group(1)) if m else None
    return None


def latest_step_dir(root: str | os.PathLike) -> str | None:
    """The path of the committed step directory of a checkpoint root (None before the first)."""
    step = _latest_step(os.fspath(root))
    return None if step is None else os.path.join(os.fspath(root), step_dir_name(step))


def model_dir(path: str) -> str:
    """`path`, or the newest verified step of it when `path` is a checkpoint root (for --model)."""
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")) \
            and (os.path.exists(os.path.join(path, LATEST)) or _step_dirs(path)):
        return find_checkpoint(path)
    return path


def _is_sharded(path: str) -> bool:
    from treeflow.train.sharded import is_sharded_checkpoint

    return is_sharded_checkpoint(path)


def load_checkpoint(cls, path: str | os.PathLike, forward, reduce, *,
                    log: Callable[[str], None] = _stderr, trust_checkpoint: bool = False,
                    **options):
    """A `cls` (Trainer) built on the newest verified checkpoint under `path`.

    trust_checkpoint: also accept a directory without a manifest (refused otherwise).
    options go to `cls` (precision, dp, ...)."""
    step_path = find_checkpoint(path, log=log, trust_checkpoint=trust_checkpoint)
    if not os.path.isfile(os.path.join(step_path, MANIFEST)):
        if _is_sharded(step_path):
            return _load_sharded(cls, step_path, forward, reduce, options, log)
        return _load_legacy(cls, step_path, forward, reduce, log, options)
    with open(os.path.join(step_path, TRAINER_JSON)) as f:
        state = json.load(f)
    if state.get("format") != FORMAT:
        raise ValueError(f"{step_path}: checkpoint format {state.get('format')!r}; this treeflow "
                         f"reads {FORMAT!r}")
    _check_state(os.path.join(step_path, TRAINER_JSON), state)
    _check_layout(step_path, state, forward)
    if _is_sharded(step_path):
        return _load_sharded(cls, step_path, forward, reduce, options, log, state)
    trainer = cls(replace(forward, model=step_path), reduce, **options)
    _note_layout(step_path, state, trainer, log)
    try:
        tensors = load_file(os.path.join(step_path, OPTIMIZER), device=str(trainer.runner.device))
    except SafetensorError as e:
        raise ValueError(f"{os.path.join(step_path, OPTIMIZER)}: unreadable ({e})") from e
    opt = state["optimizer"]
    per_param: dict[int, dict] = {}
    for key, t in tensors.items():
        _, idx, k = key.split(".", 2)
        per_param.setdefault(int(idx), {})[k] = t
    for key, v in opt["scalars"].items():
        idx, k = key.split(".", 1)
        per_param.setdefault(int(idx), {})[k] = v
    if _tensor_parallel(trainer) > 1:  # one process wrote full tensors: take this rank's block
        names = [name for name, _ in trainer.backend.named_parameters()]
        if len(names) < len(per_param):
            raise ValueError(f"{step_path}: the optimizer state holds {len(per_param)} "
                             f"parameters, this model {len(names)}")
        for idx, st in per_param.items():
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim:
                    st[k] = trainer.backend.local_part(names[idx], v)
    _check_optimizer_shapes(os.path.join(step_path, OPTIMIZER), trainer, per_param)
    try:
        trainer.optimizer.load_state_dict({"state": per_param, "param_groups": opt["param_groups"]})
    except (ValueError, KeyError) as e:
        raise ValueError(f"{step_path}: the optimizer state does not fit this model ({e})") from e
    trainer.steps = state["steps"]
    trainer.scheduler_episodes = state["scheduler_episodes"]
    trainer.position = state["position"]
    trainer.run = state.get("run")
    trainer.checkpoint_path = step_path
    return trainer


def _check_state(path: str, state) -> None:
    """ValueError naming the field of trainer.json that has the wrong type or value."""
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds {type(state).__name__}, not a JSON object")

    def count(value, field):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: field {field!r} is {json.dumps(value)}; it must be an "
                             "integer >= 0 (the file is corrupted or was edited)")

    count(state.get("steps"), "steps")
    count(state.get("scheduler_episodes"), "scheduler_episodes")
    position = state.get("position")
    if not isinstance(position, dict):
        raise ValueError(f"{path}: field 'position' is {json.dumps(position)}; it must be an "
                         "object (the input position of the run)")
    for k in ("episodes", "passes"):
        if k in position:
            count(position[k], f"position.{k}")
    if "optimizer" in state:
        opt = state["optimizer"]
        # one-process checkpoints carry AdamW's scalars here; sharded ones (train/sharded.py)
        # only the param groups, their state being in dcp/
        if not (isinstance(opt, dict) and isinstance(opt.get("param_groups"), list)
                and isinstance(opt.get("scalars", {}), dict)):
            raise ValueError(f"{path}: field 'optimizer' must be an object with 'param_groups' "
                             "(a list) and, if present, 'scalars' (an object)")
        bad = [k for k in opt.get("scalars", {}) if not re.fullmatch(r"\d+\.\w+", k)]
        if bad:
            raise ValueError(f"{path}: optimizer scalar {bad[0]!r} is not named INDEX.NAME")


def _check_optimizer_shapes(path: str, trainer, per_param: dict) -> None:
    """Refuse optimizer tensors that do not fit this model's parameters, naming the tensor."""
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    names = [n for n, _ in trainer.backend.named_parameters()]
    for idx, st in sorted(per_param.items()):
        if not 0 <= idx < len(params):
            raise ValueError(f"{path}: optimizer state for parameter {idx}, but this model has "
                             f"{len(params)}; the checkpoint is of another model")
        want = tuple(params[idx].shape)
        label = names[idx] if len(names) == len(params) else f"parameter {idx}"
        for k, v in st.items():
            if torch.is_tensor(v) and v.ndim and tuple(v.shape) != want:
                raise ValueError(f"{path}: tensor 'state.{idx}.{k}' has shape {tuple(v.shape)}, "
                                 f"but {label} is {want}; the optimizer state is of another "
                                 "model (or was edited)")


def _load_sharded(cls, path, forward, reduce, options, log, state=None):
    """A checkpoint written by data-parallel ranks (dcp/), resumed on any number of ranks."""
    from treeflow.train.sharded import load_sharded

    if state is None:
        log(f"{path}: --trust-checkpoint: a sharded checkpoint without a manifest, loaded "
            "unverified")
        with open(os.path.join(path, "treeflow_trainer.json")) as f:
            state = json.load(f)
    trainer = cls(replace(forward, model=path), reduce, **options)
    _note_layout(path, state, trainer, log)
    load_sharded(trainer, path, state)
    trainer.steps = state["steps"]
    trainer.scheduler_episodes = state["scheduler_episodes"]
    trainer.position = state["position"]
    trainer.run = state.get("run")
    trainer.checkpoint_path = path
    return trainer


def _check_layout(path: str, state: dict, forward) -> None:
    """Refuse a checkpoint of another backend before any model is built (names differ)."""
    saved = (state.get("layout") or {}).get("backend")
    if saved is not None and saved != forward.backend:
        raise ValueError(f"{path}: written by the {saved} backend, resumed with --backend "
                         f"{forward.backend}: parameter names and layouts differ; resume with "
                         f"--backend {saved} (its HF export, --model {path}, loads in either)")


def _note_layout(path: str, state: dict, trainer, log) -> None:
    layout = state.get("layout") if state else None
    if not layout:
        return
    now = _layout(trainer)
    if (layout.get("tensor_parallel"), layout.get("data_parallel")) != \
            (now["tensor_parallel"], now["data_parallel"]):
        lead = _writers(trainer)[1]
        if lead:
            log(f"{path}: written at tensor parallelism {layout.get('tensor_parallel')} x "
                f"{layout.get('data_parallel')} data-parallel ranks, resumed at "
                f"{now['tensor_parallel']} x {now['data_parallel']}: the state is resharded (the "
                "run continues with the same weights; sums may round differently)")


def _load_legacy(cls, path, forward, reduce, log, options):
    """A pre-manifest checkpoint (trainer_state.pt): read with weights_only=True, never unpickled."""
    trainer = cls(replace(forward, model=path), reduce, **options)
    try:
        state = torch.load(os.path.join(path, LEGACY_STATE), map_location=trainer.runner.device,
                           weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError...
        raise ValueError(f"{os.path.join(path, LEGACY_STATE)}: refused or unreadable as plain "
                         f"tensors ({type(e).__name__}); it may be corrupted or hold code; "
                         "only load checkpoints you trust") from e
    log(f"{path}: --trust-checkpoint: an old checkpoint layout without a manifest, loaded "
        "unverified (save again to upgrade it)")
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.steps = state["steps"]
    trainer.scheduler_episodes = state["scheduler_episodes"]
    trainer.position = state["position"]
    trainer.run = None
    trainer.checkpoint_path = path
    return trainer


__all__ = ["FORMAT", "LATEST", "LATEST_RECORD", "MANIFEST", "MODEL_FILES", "copy_model_files",
           "latest_step_dir", "find_checkpoint", "load_checkpoint", "model_dir",
           "save_checkpoint", "step_dir_name", "verify"]
