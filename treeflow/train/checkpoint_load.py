"""Loading a checkpoint: find the newest step that verifies against its manifest, rebuild the
Trainer on it (train/checkpoint.py describes the layout and how it is written).

Verification reads every listed file once and compares size and sha256 (about a second per
GB); a directory holding a file its manifest does not list is refused, naming the file. A
step whose manifest does not verify is skipped for the newest older one that does, saying
which and why, so a torn or corrupted checkpoint is never resumed silently. Nothing is
unpickled: safetensors and JSON here, DCP's index through train/dcp_safe.py, a pre-manifest
`trainer_state.pt` only weights-only and only under `trust_checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from treeflow._json import load as load_json
from treeflow.tensorfile import FILES_AT_ONCE, index_name, stored_files

from treeflow.train.checkpoint_layout import (LATEST, LEGACY_STATE, MANIFEST, OPTIMIZER, FORMAT,
                                              OPTIMIZER_STEM,
                                              TRAINER_JSON, latest_step, layout_of, sha256_of,
                                              note_stderr, step_dirs, tensor_parallel_of, writers_of,
                                              step_dir_name, is_checkpoint_root,
                                              is_sharded_checkpoint)


def verify(step_path: str) -> str | None:
    """None when the step directory is complete and unmodified; else what is wrong with it."""
    mpath = os.path.join(step_path, MANIFEST)
    if not os.path.isfile(mpath):
        return f"no {MANIFEST} (the save did not finish)"
    try:
        files = _manifest_files(step_path, load_json(mpath, what=mpath))
    except ValueError as e:
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
    names = sorted(files)
    # one sha256 stream per file, several files at once (hashlib lets go of the GIL): a sharded
    # checkpoint verifies at the disk's speed; the first bad file in name order is named
    with ThreadPoolExecutor(max_workers=FILES_AT_ONCE) as pool:
        digests = list(pool.map(lambda n: sha256_of(os.path.join(step_path, n)), names))
    for name, digest in zip(names, digests):
        if digest != files[name]["sha256"]:
            return f"{name} does not match its sha256 in {MANIFEST} (corrupted or modified)"
    return None



def _manifest_files(step_path: str, manifest) -> dict:
    """The manifest's `files` table, checked: every name a relative path inside `step_path`
    (no `..`, no absolute path, no link out of it), every entry {bytes: int, sha256: str}."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise ValueError("it holds no 'files' object")
    root = os.path.realpath(step_path)
    for name, want in files.items():
        inside = os.path.realpath(os.path.join(root, name))
        if (os.path.isabs(name) or os.path.normpath(name) != name or name.startswith("..")
                or os.path.commonpath([root, inside]) != root or inside == root):
            raise ValueError(f"entry {name!r} is not a file inside the checkpoint (every path "
                             "must stay in its step directory)")
        if not (isinstance(want, dict) and type(want.get("bytes")) is int
                and isinstance(want.get("sha256"), str)):
            raise ValueError(f"entry {name!r} is {json.dumps(want)[:80]}; give "
                             '{"bytes": N, "sha256": HEX}')
    return files


def _unlisted(step_path: str, files: dict) -> list[str]:
    """Files (and links to directories) under `step_path` that the manifest does not list."""
    found = []
    for d, dirs, names in os.walk(step_path):
        found += [os.path.relpath(os.path.join(d, n), step_path) for n in dirs
                  if os.path.islink(os.path.join(d, n))]
        found += [os.path.relpath(os.path.join(d, n), step_path) for n in names]
    return sorted(n for n in found if n != MANIFEST and n not in files)


def find_checkpoint(path: str | os.PathLike, *, log: Callable[[str], None] = note_stderr,
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
    if os.path.isfile(os.path.join(path, LEGACY_STATE)) or is_sharded_checkpoint(path):
        if not trust_checkpoint:
            what = LEGACY_STATE if os.path.isfile(os.path.join(path, LEGACY_STATE)) else "dcp/"
            raise ValueError(f"{path}: holds {what} but no {MANIFEST}, so it cannot be verified "
                             "(an older treeflow's checkpoint, or one from elsewhere); resume it "
                             "only if you trust who wrote it, with --trust-checkpoint "
                             "(API: trust_checkpoint=True)")
        return path
    steps = step_dirs(path)
    if not steps:
        raise ValueError(f"{path}: not a treeflow training checkpoint (no step-NNNNNN directory, "
                         f"no {MANIFEST}); give the directory that --save wrote")
    skipped = []
    committed = latest_step(path)
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


def latest_step_dir(root: str | os.PathLike) -> str | None:
    """The path of the committed step directory of a checkpoint root (None before the first)."""
    step = latest_step(os.fspath(root))
    return None if step is None else os.path.join(os.fspath(root), step_dir_name(step))


def model_dir(path: str) -> str:
    """`path`, or the newest verified step of it when `path` is a checkpoint root (for --model)."""
    return find_checkpoint(path) if is_checkpoint_root(path) else path


def load_checkpoint(cls, path: str | os.PathLike, forward, reduce, *,
                    log: Callable[[str], None] = note_stderr, trust_checkpoint: bool = False,
                    **options):
    """A `cls` (Trainer) built on the newest verified checkpoint under `path`.

    trust_checkpoint: also accept a directory without a manifest (refused otherwise).
    options go to `cls` (precision, dp, ...)."""
    step_path = find_checkpoint(path, log=log, trust_checkpoint=trust_checkpoint)
    if not os.path.isfile(os.path.join(step_path, MANIFEST)):
        if is_sharded_checkpoint(step_path):
            return _load_sharded(cls, step_path, forward, reduce, options, log)
        return _load_legacy(cls, step_path, forward, reduce, log, options)
    state = load_json(os.path.join(step_path, TRAINER_JSON))
    if not isinstance(state, dict):
        _check_state(os.path.join(step_path, TRAINER_JSON), state)
    if state.get("format") != FORMAT:
        raise ValueError(f"{step_path}: checkpoint format {state.get('format')!r}; this treeflow "
                         f"reads {FORMAT!r}")
    _check_state(os.path.join(step_path, TRAINER_JSON), state)
    _check_layout(step_path, state, forward)
    if is_sharded_checkpoint(step_path):
        return _load_sharded(cls, step_path, forward, reduce, options, log, state)
    trainer = cls(replace(forward, model=step_path), reduce, **options)
    _note_layout(step_path, state, trainer, log)
    tensors, opt_path = _optimizer_state(step_path, str(trainer.runner.device))
    opt = state["optimizer"]
    per_param: dict[int, dict] = {}
    for key, t in tensors.items():
        _, idx, k = key.split(".", 2)
        per_param.setdefault(int(idx), {})[k] = t
    for key, v in opt["scalars"].items():
        idx, k = key.split(".", 1)
        per_param.setdefault(int(idx), {})[k] = v
    if tensor_parallel_of(trainer) > 1:  # one process wrote full tensors: take this rank's block
        names = [name for name, _ in trainer.backend.named_parameters()]
        if len(names) < len(per_param):
            raise ValueError(f"{step_path}: the optimizer state holds {len(per_param)} "
                             f"parameters, this model {len(names)}")
        for idx, st in per_param.items():
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim:
                    st[k] = trainer.backend.local_part(names[idx], v)
    _check_optimizer_shapes(opt_path, trainer, per_param)
    _check_optimizer_finite(opt_path, os.path.join(step_path, TRAINER_JSON), per_param)
    try:
        trainer.optimizer.load_state_dict({"state": per_param, "param_groups": opt["param_groups"]})
    except (ValueError, KeyError) as e:
        raise ValueError(f"{step_path}: the optimizer state does not fit this model ({e})") from e
    return _restored(trainer, state, step_path)


def _restored(trainer, state: dict, path: str):
    """`trainer` with the counters of the checkpoint at `path` (its trainer state `state`):
    every layout's last step."""
    trainer.steps = state["steps"]
    trainer.scheduler_episodes = state["scheduler_episodes"]
    trainer.position = state["position"]
    trainer.run = state.get("run")
    trainer.checkpoint_path = path
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
        _check_param_groups(path, opt["param_groups"])


# AdamW's hyperparameters in a param group: (field, how many numbers; 0 = one number)
_GROUP_NUMBERS = {"lr": 0, "initial_lr": 0, "weight_decay": 0, "eps": 0, "betas": 2}


def _check_param_groups(path: str, groups: list) -> None:
    """Each param group's AdamW numbers finite numbers (a string in `betas` reached
    torch as a TypeError), its `params` a list of ints."""
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            raise ValueError(f"{path}: optimizer.param_groups[{i}] is {json.dumps(g)[:60]}; it "
                             "must be an object")
        for field, n in _GROUP_NUMBERS.items():
            if field not in g:
                continue
            v = g[field]
            vals = v if n and isinstance(v, list) and len(v) == n else [v] if not n else None
            if vals is None or not all(_finite_number(x) for x in vals):
                want = f"a list of {n} finite numbers" if n else "a finite number"
                raise ValueError(f"{path}: optimizer.param_groups[{i}].{field} is "
                                 f"{json.dumps(v)[:60]}; it must be {want} (the file is "
                                 "corrupted or was edited)")
        params = g.get("params", [])  # indices or names; absent where DCP holds the state
        if not (isinstance(params, list) and all(type(x) in (int, str) for x in params)):
            raise ValueError(f"{path}: optimizer.param_groups[{i}].params must be a list of "
                             "parameter indices or names")


def _finite_number(x) -> bool:
    return type(x) in (int, float) and x == x and abs(x) != float("inf")


def _check_optimizer_finite(path: str, state_path: str, per_param: dict) -> None:
    """Refuse NaN or inf in AdamW's saved state, as weights are refused at load
    (models/checkpoint.py): resumed, one NaN turns every later weight into NaN."""
    for idx, st in sorted(per_param.items()):
        for k, v in sorted(st.items()):
            bad = (int((~torch.isfinite(v)).sum()) if torch.is_tensor(v) and v.is_floating_point()
                   else 0 if torch.is_tensor(v) else int(not _finite_number(v)))
            if bad:
                where = path if torch.is_tensor(v) else f"{state_path}: optimizer scalar"
                raise ValueError(f"{where}: 'state.{idx}.{k}' holds {bad} non-finite value(s) "
                                 "(NaN or inf); the optimizer state is corrupted: resume from an "
                                 "earlier checkpoint")


def _optimizer_state(step_path: str, device: str) -> tuple[dict, str]:
    """AdamW's tensors from `optimizer.safetensors` or its shards; and the path to name."""
    files = stored_files(step_path, OPTIMIZER_STEM)
    if files is None:
        raise ValueError(f"{step_path}: no {OPTIMIZER} or {index_name(OPTIMIZER_STEM)} (the "
                         "optimizer state is missing)")
    tensors: dict = {}
    for file in files:
        try:
            tensors.update(load_file(file, device=device))
        except SafetensorError as e:
            raise ValueError(f"{file}: unreadable ({e})") from e
    single = len(files) == 1 and os.path.basename(files[0]) == OPTIMIZER
    return tensors, files[0] if single else os.path.join(step_path, index_name(OPTIMIZER_STEM))


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
        state = load_json(os.path.join(path, "treeflow_trainer.json"))
    trainer = cls(replace(forward, model=path), reduce, **options)
    _note_layout(path, state, trainer, log)
    load_sharded(trainer, path, state)
    return _restored(trainer, state, path)


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
    now = layout_of(trainer)
    if (layout.get("tensor_parallel"), layout.get("data_parallel")) != \
            (now["tensor_parallel"], now["data_parallel"]):
        lead = writers_of(trainer)[1]
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
    return _restored(trainer, {**state, "run": None}, path)  # saved before runs were recorded


__all__ = ["find_checkpoint", "latest_step_dir", "load_checkpoint", "model_dir", "verify"]
