"""What defines a training run, so that `--resume` can check it continues the same one.

A fingerprint holds, per input file, its name, size, row count and a BLAKE2b
hash of the whole file (so a change anywhere in it, even one that keeps the
size and the rows, is seen), plus the options that define a step (batch
size, loss, schedule, clipping). Options that change only how a step is
computed (layout, fragment size, kernel, device) are left out: resuming on
another machine is allowed. Renaming the directory that holds the data is
allowed too; only base names are compared.

The trade-off: hashing reads every input once (0.3-1 GB/s on one core) at
the start of a run. Hashes are cached by (path, inode, size, mtime_ns) in
this process and in `$TREEFLOW_CACHE_DIR` (default `~/.cache/treeflow`), so a
file that has not been written since it was last hashed costs nothing; a
rewrite changes its mtime and is hashed again. A fingerprint saved by an
older treeflow (first MiB only) is compared on the fields both hold.
"""

from __future__ import annotations

import hashlib
import json
import os

from treeflow.schemas.episode import count_rows, expand_paths

STEP_OPTIONS = ("episodes_per_step", "loss", "norm", "clip_low", "clip_high", "tis_cap", "lr",
                "warmup_episodes", "decay_episodes", "max_grad_norm", "advantage", "kl_coef",
                "entropy_coef")
_ADDED = ("kl_coef", "entropy_coef")  # compared only against checkpoints that recorded them
_OLD_NAMES = {"episodes_per_step": "batch_episodes"}  # what an older checkpoint calls it
_HEAD_BYTES = 1 << 20
_BLOCK = 1 << 22
_FIELDS = ("bytes", "rows", "head_sha256", "blake2b")
_memo: dict[tuple, dict] = {}


def _cache_dir() -> str:
    return os.environ.get("TREEFLOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "treeflow")


def file_hashes(path: str) -> dict:
    """{"head_sha256", "blake2b"} of a file: its first MiB and the whole of it, cached."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _memo:
        return _memo[key]
    cached = os.path.join(_cache_dir(), "hashes",
                          hashlib.sha256(repr(key).encode()).hexdigest() + ".json")
    try:
        with open(cached) as f:
            got = json.load(f)
        if isinstance(got, dict) and set(got) == {"head_sha256", "blake2b"}:
            _memo[key] = got
            return got
    except (OSError, ValueError):
        pass
    head, whole = hashlib.sha256(), hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        head_left = _HEAD_BYTES
        for block in iter(lambda: f.read(_BLOCK), b""):
            if head_left > 0:
                head.update(block[:head_left])
                head_left -= len(block)
            whole.update(block)
    got = {"head_sha256": head.hexdigest(), "blake2b": whole.hexdigest()}
    if os.stat(path).st_mtime_ns == st.st_mtime_ns:  # not written while it was read
        _memo[key] = got
        try:
            from treeflow.atomic import atomic_open

            os.makedirs(os.path.dirname(cached), exist_ok=True)
            with atomic_open(cached, what="hash cache") as f:
                json.dump(got, f)
        except (OSError, ValueError):
            pass  # a cache that cannot be written only costs a re-hash next time
    return got


def data_fingerprint(paths) -> list[dict]:
    return [{"name": os.path.basename(p), "bytes": os.path.getsize(p), "rows": count_rows([p]),
             **file_hashes(p)} for p in expand_paths(paths)]


def run_fingerprint(paths, options: dict) -> dict:
    return {"data": data_fingerprint(paths), "options": {k: options[k] for k in STEP_OPTIONS}}


def differences(saved: dict, now: dict) -> list[str]:
    """Human-readable differences between a checkpoint's fingerprint and this run's."""
    out = []
    for k in STEP_OPTIONS:
        options = saved.get("options", {})
        if k in _ADDED and k not in options:
            continue
        a, b = options.get(k, options.get(_OLD_NAMES.get(k))), now["options"].get(k)
        if a != b:
            out.append(f"--{k.replace('_', '-')} was {a}, now {b}")
    old, new = saved.get("data", []), now["data"]
    if [d["name"] for d in old] != [d["name"] for d in new]:
        out.append(f"input files were {[d['name'] for d in old]}, now {[d['name'] for d in new]}")
    else:
        for a, b in zip(old, new):
            changed = [k for k in _FIELDS if k in a and k in b and a[k] != b[k]]
            if changed:
                sizes = [f"{k} {a[k]} -> {b[k]}" for k in changed if k in ("bytes", "rows")]
                out.append(f"input {a['name']} changed ("
                           + ("; ".join(sizes) if sizes else "same size and rows, other content")
                           + ")")
    return out


__all__ = ["STEP_OPTIONS", "data_fingerprint", "differences", "file_hashes", "run_fingerprint"]
