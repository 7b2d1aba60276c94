"""What defines a training run, so that `--resume` can check it continues the same one.

A fingerprint holds, per input file, its name, size, row count and a sha256
of its first MiB (cheap on any file size, and different for any rewrite of
the first rows), plus the options that define a step (batch size, loss,
schedule, clipping). Options that change only how a step is computed
(layout, fragment size, kernel, device) are left out: resuming on another
machine is allowed. Renaming the directory that holds the data is allowed
too; only base names are compared.
"""

from __future__ import annotations

import hashlib
import os

from treeflow.schemas.episode import count_rows, expand_paths

STEP_OPTIONS = ("batch_episodes", "loss", "norm", "clip_low", "clip_high", "tis_cap", "lr",
                "warmup_episodes", "decay_episodes", "max_grad_norm", "advantage")
_HEAD_BYTES = 1 << 20


def data_fingerprint(paths) -> list[dict]:
    out = []
    for p in expand_paths(paths):
        with open(p, "rb") as f:
            head = hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()
        out.append({"name": os.path.basename(p), "bytes": os.path.getsize(p),
                    "rows": count_rows([p]), "head_sha256": head})
    return out


def run_fingerprint(paths, options: dict) -> dict:
    return {"data": data_fingerprint(paths), "options": {k: options[k] for k in STEP_OPTIONS}}


def differences(saved: dict, now: dict) -> list[str]:
    """Human-readable differences between a checkpoint's fingerprint and this run's."""
    out = []
    for k in STEP_OPTIONS:
        a, b = saved.get("options", {}).get(k), now["options"].get(k)
        if a != b:
            out.append(f"--{k.replace('_', '-')} was {a}, now {b}")
    old, new = saved.get("data", []), now["data"]
    if [d["name"] for d in old] != [d["name"] for d in new]:
        out.append(f"input files were {[d['name'] for d in old]}, now {[d['name'] for d in new]}")
    else:
        for a, b in zip(old, new):
            changed = [k for k in ("bytes", "rows", "head_sha256") if a.get(k) != b.get(k)]
            if changed:
                out.append(f"input {a['name']} changed ({', '.join(changed)}: "
                           + ", ".join(f"{a.get(k)} -> {b.get(k)}" for k in changed if k != "head_sha256")
                           + ("" if changed != ["head_sha256"] else "same size, other content") + ")")
    return out


__all__ = ["STEP_OPTIONS", "data_fingerprint", "differences", "run_fingerprint"]
