"""The names and records of a checkpoint root, shared by saving (train/checkpoint.py) and
loading (train/checkpoint_load.py): file names, the step-directory pattern, the `latest`
commit record, file hashes, and which processes write a checkpoint together.

See train/checkpoint.py for the layout and its crash-safety argument.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

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
OPTIMIZER_STEM = "optimizer"      # optimizer.safetensors, or its shards and index (tensorfile.py)
OPTIMIZER = f"{OPTIMIZER_STEM}.safetensors"
TRAINER_JSON = "trainer.json"
LEGACY_STATE = "trainer_state.pt"
DCP_DIR = "dcp"  # a sharded checkpoint's torch.distributed.checkpoint files (train/sharded.py)
FORMAT = "treeflow-checkpoint/2"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir_name(steps: int) -> str:
    return f"step-{steps:06d}"


def sha256_of(path: str, *, trust_own_writes: bool = False) -> str:
    if trust_own_writes:  # a file this process just wrote: hashed while it was written
        from treeflow.tensorfile import written_sha256  # torch: not for the CLI's path checks

        known = written_sha256(path)
        if known is not None:
            return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, name) of the step directories under `root`, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _STEP_DIR.match(n))
             and os.path.isdir(os.path.join(root, n))]
    return sorted(found, reverse=True)


def is_checkpoint_root(path: str) -> bool:
    """Whether `path` is a checkpoint root (step directories, or `latest`), not a model
    directory (its config.json); plain file checks, no torch: the CLI asks before any work."""
    return (os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json"))
            and (os.path.exists(os.path.join(path, LATEST)) or bool(step_dirs(path))))


def latest_step(root: str) -> int | None:
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


def tensor_parallel_of(trainer) -> int:
    return getattr(getattr(trainer, "backend", None), "tp", 1)


def writers_of(trainer) -> tuple[bool, bool, object]:
    """(distributed, lead, group): the processes that write one checkpoint together.

    Every process that holds a part of the model takes part: the data-parallel ranks, and
    under tensor parallelism every tensor-parallel rank of every replica (the whole world,
    since each holds different shards); the lead (rank 0 of that group) commits.
    """
    dp = getattr(trainer, "dp", None)
    if tensor_parallel_of(trainer) > 1:
        import torch.distributed as dist

        return True, dist.get_rank() == 0, dist.group.WORLD
    distributed = dp is not None and dp.distributed
    return distributed, not distributed or dp.rank == 0, dp.group if distributed else None


def layout_of(trainer) -> dict:
    """What wrote the checkpoint: backend and parallel sizes (checked and reported on resume)."""
    dp = getattr(trainer, "dp", None)
    return {"backend": getattr(getattr(trainer, "backend", None), "name", None),
            "tensor_parallel": tensor_parallel_of(trainer),
            "data_parallel": dp.world if dp is not None else 1}


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` holds a sharded (DCP) checkpoint; told by its files alone, so that finding
    a checkpoint to resume never imports torch.distributed.checkpoint (seconds per process)."""
    return os.path.isfile(os.path.join(path, DCP_DIR, ".metadata"))


def note_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


__all__ = ["CONFIG_JSON", "DCP_DIR", "FORMAT", "LATEST", "LATEST_RECORD", "LEGACY_STATE",
           "MANIFEST", "MODEL_FILES", "OPTIMIZER", "OPTIMIZER_STEM", "TRAINER_JSON",
           "is_sharded_checkpoint", "step_dir_name"]
