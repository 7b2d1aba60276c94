"""Run `treeflow replay ... --json` in this process and add where its compile time went.

`compile_seconds` in the CLI's JSON is the warm-up's wall time: dynamo tracing the
Python code of each compiled function, AOTAutograd, inductor generating (or loading
from the compile cache) and building kernels, and the first runs of the kernels.
A second run with a warm `--compile-cache` skips only the generating and building.
This wrapper runs the CLI in-process and appends to its JSON line:

- `graphs`: dynamo's unique graphs (one per compiled function x grad mode x stride
  pattern; the layer parts are dynamic in the token count, flex is padded to the
  budget), and `frames` (compiled frames, recompiles included);
- `dynamo_phases`: seconds per phase of dynamo's own timers (`bytecode_tracing`,
  `OutputGraph.call_user_compiler`, `build_guards`, ...; torch's
  `compilation_time_metrics`, summed over calls);
- `dynamo_phases_all`: every timer dynamo kept (>= 5 ms): inductor's import, cache
  loads, the precompiled loads (`AOTAutogradCache.inductor_load`, ...);
- `inductor`, `aot_autograd`: the cache hit/miss counters;
- `warm_up_parts`: seconds of the warm-up's imports of dynamo and inductor (counted in
  `compile_seconds`, as without this wrapper), its budget-sized tree bin and its chain bin;
- `precompiled`: per layer graph, variants loaded from and captured into the compile
  cache (treeflow/models/compile/precompiled.py), whether it fell back to torch.compile,
  and `build_seconds` (its captures and ahead-of-time builds).

Environment, for probes: `TREEFLOW_BENCH_WARM_CPU=1` runs the warm-up on CPU as well (it is
CUDA only), `TREEFLOW_BENCH_WARM_TREES=1` gives it the tree bin whatever the layout (the
warm-up before issue 46: an exact run built the flex kernel it never uses),
`TREEFLOW_BENCH_AOTI_CPU=1` runs the layers of `--tuning compile_layers=1` through inductor and
AOTInductor on CPU too (C++ kernels; layer_ops() compiles with inductor on CUDA only): the
GPU's compile path, with its builds per graph counted in `precompiled`, on a CPU machine.

    python bench/compile_times_cli.py replay EPISODES.arrow --model CKPT --device cuda ... --json
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

_PHASES = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler",
           "create_aot_dispatcher_function", "aot_collect_metadata", "build_guards",
           "compile_fx_inner", "inductor_compile", "async_compile.wait", "PyCodeCache.load_by_key_path")
_WARM_UP: dict = {}  # what the runner's warm-up measured, and the imports it would have paid


def compile_report() -> dict:
    """Dynamo's graph count, per-phase seconds and the cache counters of this process."""
    if "torch._dynamo" not in sys.modules:
        return {"graphs": 0, **_WARM_UP}
    from torch._dynamo import utils

    metrics = getattr(utils, "compilation_time_metrics", {})
    counters = utils.counters
    # every timer dynamo kept (>= 5 ms), not only the named ones: what a warm run still pays
    phases = {k: round(sum(v), 3) for k, v in metrics.items() if sum(v) >= 0.005}
    report = {"graphs": int(counters["stats"]["unique_graphs"]),
              "frames": {k: int(v) for k, v in counters["frames"].items()},
              "dynamo_phases": {k: phases[k] for k in _PHASES if k in phases},
              "dynamo_phases_all": phases,
              "inductor": {k: int(v) for k, v in counters["inductor"].items() if "cache" in k},
              "aot_autograd": {k: int(v) for k, v in counters["aot_autograd"].items()
                               if "cache" in k}, **_WARM_UP}
    isa = sys.modules.get("treeflow.models.compile.vec_isa")
    if isa is not None and isa.done:  # the CPU vector-ISA probe: checks answered from the record
        report["vec_isa"] = dict(isa.done)
    pre = sys.modules.get("treeflow.models.compile.precompiled")
    if pre is not None:
        report["precompiled"] = pre.stats()
    return report


def _time_warm_up() -> None:
    """Wrap ForwardRunner.warm_up: the imports it pays first timed apart, then its dummy bins."""
    import time

    from treeflow.ops import runner

    inner = runner.ForwardRunner.warm_up

    def warm_up(self, *, grad: bool = False, **kwargs) -> float:  # trees= where the tree has it
        t0 = time.perf_counter()
        if self.device.type == "cuda":  # what compiling imports first (the seconds stay counted)
            import torch._dynamo  # noqa: F401
            import torch._inductor.compile_fx  # noqa: F401
        imports = time.perf_counter() - t0
        if os.environ.get("TREEFLOW_BENCH_WARM_TREES") == "1":  # the warm-up before issue 46
            kwargs["trees"] = True
        seconds = inner(self, grad=grad, **kwargs)
        _WARM_UP["warm_up_parts"] = {"imports": round(imports, 3), **{
            k: round(v, 3) for k, v in getattr(self, "warm_up_parts", {}).items()}}
        if hasattr(self, "warm_up_builds"):  # the ahead-of-time builds' pool (build_pool.py)
            _WARM_UP["warm_up_builds"] = {k: round(v, 3) for k, v in self.warm_up_builds.items()}
        if hasattr(self, "warm_up_ahead"):  # the first pass's Triton builds (jit_watch.py)
            _WARM_UP["warm_up_ahead"] = dict(self.warm_up_ahead)
        return seconds + imports

    runner.ForwardRunner.warm_up = warm_up


def _aoti_on_cpu() -> None:
    """The decoder's layer_ops with inductor and ahead-of-time graphs on every device."""
    from treeflow.models.compile.layer_ops import LayerOps, layer_ops
    from treeflow.models.reference import decoder

    made: dict = {}

    def ops(tuning, device):
        if tuning is None or not tuning.compile_layers or tuning.compile_backend != "inductor":
            return layer_ops(tuning, device)
        if tuning.recompute not in made:
            made[tuning.recompute] = LayerOps(compile_backend="inductor",
                                              recompute=tuning.recompute, ahead_of_time=True)
        return made[tuning.recompute]

    decoder.layer_ops = ops


def main(argv: list[str]) -> int:
    from treeflow.cli import main as cli_main

    _time_warm_up()
    if os.environ.get("TREEFLOW_BENCH_WARM_CPU") == "1":  # the CUDA warm-up run on CPU too
        from treeflow.ops import warm_up

        warm_up.runs_on = lambda device: True
    if os.environ.get("TREEFLOW_BENCH_AOTI_CPU") == "1":
        _aoti_on_cpu()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(argv)
    lines = out.getvalue().strip().splitlines()
    if rc != 0 or not lines:
        print(out.getvalue(), end="")
        return rc
    print("\n".join(lines[:-1]))
    print(json.dumps({**json.loads(lines[-1]), **compile_report()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
