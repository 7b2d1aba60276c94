"""What every command checks the same way: counts by their flag, the device, a line on stderr;
the CUDA allocator's configuration a run on a GPU starts with."""

from __future__ import annotations

import json
import os
import sys

__all__ = ["alloc_conf", "check_device", "cuda_allocator", "positive", "say", "show"]


def say(message: str) -> None:
    """One unwrapped line on stderr (rich would wrap it at the terminal width)."""
    print(message, file=sys.stderr)


def show(args, title: str, summary: dict) -> bool:
    """A command's summary: one JSON line with --json, else a table (its scalar fields) unless
    --quiet; whether the table was shown."""
    if args.json:
        print(json.dumps(summary), flush=True)
        return False
    if getattr(args, "quiet", False):
        return False
    from treeflow._display import console, table

    console().print(table(title, [(k, v) for k, v in summary.items() if not isinstance(v, dict)]))
    return True


def positive(args, *names) -> None:
    """Refuse a count option below 1, naming the option (not the stage it would reach)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: give an integer >= 1")


def check_device(device: str) -> None:
    """Refuse a --device torch does not know, or CUDA where there is none, before any work.

    "cpu" (the default) is always there, so it is taken without importing torch: the Ray
    engine's driver never runs a model, and torch's import (about 1 s) would delay its rank
    actors' start."""
    if device == "cpu":
        return
    from treeflow.stages.forward import resolve_device

    resolve_device(device, what="--device")


ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch >= 2.9's name, the older
ALLOC_DEFAULT = "expandable_segments:True"


def cuda_allocator(args) -> None:
    """A run on a CUDA device gets the caching allocator's expandable segments unless the user
    configured the allocator (either variable set, even empty) or this process's allocator
    already started (main() called from Python after CUDA work). Fixed-size cached blocks
    fragment under a training step's mix of activation and optimizer sizes: on an H100 the
    4-layer Qwen3-30B-A3B shape with --recompute selective at 32768 tokens ran out of memory
    with 2.0 GiB of its process's reservation cached but unusable (another ~13 GiB of the card
    held by the bench's own process), and peaked at 64.7 GiB with expandable segments beside
    the same load (bench/results/h100_bench_memory_gpu_issue44.json). NeMo RL's and
    Megatron's recipes run with it too. Said once on stderr; replay's and train's run JSON
    (`cuda_alloc_conf`) say what ran. Set in this process's environment: ranks it spawns and
    a Ray cluster it starts inherit it, workers of a cluster it attaches to do not."""
    if not str(getattr(args, "device", "cpu")).startswith("cuda"):
        return
    if any(name in os.environ for name in ALLOC_ENV):
        return
    if _cuda_started():  # main() called in a process whose allocator is set up already
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_DEFAULT
    print(f"treeflow: PYTORCH_CUDA_ALLOC_CONF={ALLOC_DEFAULT} (treeflow's default on CUDA: "
          "cached blocks fragment in training); set PYTORCH_CUDA_ALLOC_CONF to choose",
          file=sys.stderr, flush=True)


def _cuda_started() -> bool:
    """Whether this process has made its CUDA context (and so its allocator) already."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def alloc_conf() -> str | None:
    """The CUDA allocator's configuration this process runs with (the run JSON's
    `cuda_alloc_conf`), or None where neither variable is set."""
    for name in ALLOC_ENV:
        if name in os.environ:
            return f"{name}={os.environ[name]}"
    return None
