"""What every command checks the same way: counts by their flag, the device, a line on stderr."""

from __future__ import annotations

import json
import sys

__all__ = ["check_device", "positive", "say", "show", "steady_state"]


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
    """Refuse a --device torch does not know, or CUDA where there is none, before any work."""
    from treeflow.stages.forward import resolve_device

    resolve_device(device, what="--device")


def steady_state(sums: dict, wall: float, setup: float) -> float:
    """Fill a logprobs run's timing and throughput into `sums`; return its steady seconds.

    wall: seconds from the process's start (treeflow._clock) to the end of the run; setup:
    from the process's start to the engine's start. Start-up (interpreter start, imports,
    device initialisation: `setup`; then the model load) and compile/warm-up are one-off
    costs reported on their own; steady state is the rest of the wall time: reading,
    preparing, running and writing every window, pipeline fill and drain included.
    `phases` says when (seconds since the process started) the command's imports were done
    (`imported`), the engine started (`engine`), the first window was planned (the CPU
    stages), the model was loaded (`loaded`) and compiled (`compiled`), and the run ended.
    """
    import resource

    load = sums.pop("load_seconds", 0.0)
    startup = setup + load
    steady = max(wall - startup - sums["compile_seconds"], 1e-9)
    marks = {k: sums.pop(f"{k}_at") for k in ("imported", "planned", "loaded", "compiled")
             if f"{k}_at" in sums}
    sums.update(wall_seconds=round(wall, 3), startup_seconds=round(startup, 3),
                load_seconds=round(load, 3),
                compile_seconds=round(sums["compile_seconds"], 3), steady_seconds=round(steady, 3),
                exact_tokens_per_s=round(sums["exact_tokens"] / steady),
                executed_tokens_per_s=round(sums["executed_tokens"] / steady),
                saving=round(sums["exact_tokens"] / max(sums["executed_tokens"], 1), 3),
                peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                phases={**{k: round(v, 3) for k, v in marks.items()}, "engine": round(setup, 3),
                        "done": round(wall, 3)})
    for k in ("prepare_seconds", "device_seconds"):
        if k in sums:
            sums[k] = round(sums[k], 3)
    return steady
