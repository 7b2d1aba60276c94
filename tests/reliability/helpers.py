"""Shared pieces of the reliability tests: a small valid data file, a CLI runner, file hashes."""

from __future__ import annotations

import hashlib
import json
import os

import pyarrow as pa

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes

TRAIN = ["--mode", "train", "--episodes-per-step", "2", "--lr", "1e-2", "--loss", "pg",
         "--norm", "seq-mean", "--max-tokens", "256", "--json"]


def small_episodes(n: int = 6, seed: int = 11) -> pa.Table:
    return synth_episodes(episodes=n, group_size=2, turns=(2, 3), system_tokens=20,
                          user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6), seed=seed)


def write_small(path, n: int = 6, seed: int = 11) -> str:
    write_episodes(small_episodes(n, seed), path)
    return str(path)


def cli(capsys, *argv) -> tuple[int, str, str]:
    """Run the CLI in-process; (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def tree_hashes(root) -> dict[str, str]:
    """Relative path -> sha256 of every file under `root` (the whole state a command may touch)."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def final_weights(ckpt_dir) -> dict:
    """The model tensors of a checkpoint directory (the step `latest` names, or a flat one)."""
    from safetensors.torch import load_file

    latest = os.path.join(ckpt_dir, "latest.txt")  # the commit record (`latest` is a symlink)
    if os.path.exists(latest):
        with open(latest) as f:
            ckpt_dir = os.path.join(ckpt_dir, f.read().strip())
    # copies, not views of a memory map: a test that later edits the file in place must not
    # change tensors it already read
    return {k: v.clone() for k, v in load_file(os.path.join(ckpt_dir, "model.safetensors")).items()}


def metrics_steps(path) -> list[int]:
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def refused(rc, err, *needles):
    """A refusal: exit 2, one `error:` line naming every needle, no traceback; warnings (what
    the run did other than asked) are their own lines before it."""
    assert rc == 2, err
    err = "".join(line for line in err.splitlines(True) if not line.startswith("warning:"))
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
