"""Run `treeflow replay ... --json` with the CUDA kernels traced, as a check of `device_busy`.

The CLI's own `device_busy` is the time between CUDA events recorded around
every bin's work, over steady wall time. Events bracket a bin on the GPU's
timeline, so a bin whose kernels were queued late by the host counts its
gaps as busy. This wrapper measures busy time a second way: torch.profiler
(CUPTI activity tracing, `ProfilerActivity.CUDA` only, no CPU op recording)
traces every kernel, copy and memset from the end of the model's warm-up
(the hook wraps `Worker.warm_up`, in this process only) to the end of the
run; `kernel_busy` is the union of those intervals over the same span of
wall time. Tracing costs a little per kernel, so the run it measures is
slightly slower than an untraced one; the two busy figures are from the same
run.

    python bench/profiled_cli.py replay EPISODES.arrow --model CKPT --device cuda ... --json

Prints one JSON line: the CLI's own, plus `profiled_seconds`, `kernel_busy_seconds`,
`kernel_busy`, `kernels`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def busy_seconds(trace_path: str) -> tuple[float, int]:
    """Union of the device activity intervals of a Chrome trace (seconds) and their count."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e6, len(spans)


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from treeflow.cli import main as cli_main
    from treeflow.pipeline import plan

    cuda = torch.cuda.is_available()  # without CUDA: a smoke run of this script (busy 0)
    prof = profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU])
    span: dict = {}
    warm_up = plan.Worker.warm_up

    def warm_up_then_trace(self):
        seconds = warm_up(self)
        if cuda:
            torch.cuda.synchronize()
        prof.start()
        span["start"] = time.perf_counter()
        return seconds

    plan.Worker.warm_up = warm_up_then_trace
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(sys.argv[1:])
    if rc:
        raise SystemExit(rc)
    if cuda:
        torch.cuda.synchronize()
    span["end"] = time.perf_counter()
    prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        busy, kernels = busy_seconds(trace)
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    profiled = span["end"] - span["start"]
    result.update(profiled_seconds=round(profiled, 3), kernel_busy_seconds=round(busy, 3),
                  kernel_busy=round(busy / profiled, 3), kernels=kernels)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
