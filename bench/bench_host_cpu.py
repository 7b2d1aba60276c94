"""Host (CPU) work per bin of `treeflow replay`, everything but the model's own compute.

The GPU benchmark (bench_cli_gpu.py) found the H200 idle part of the time in
tree replay. This script measures, on the CPU, what the host must do per bin
besides launching the model: reading and validating episodes, Pack,
Fragment, Shard, window sums, the host half of the forward (attention plans,
flex block masks, host buffers), the launch loop around the model, edge
values, reassembly and writing the results. It uses the GPU bench's data
(`treeflow synth --episodes 512 --group-size 8 --vocab-size 32000
--min-turns 3 --max-turns 10 --seed 0`, `--max-tokens 32768`, `--window 64`)
and the Qwen2-0.5B shape's vocabulary.

The model is replaced, in this script only, by a no-op backend: the real
attention plans are built exactly as on CUDA (flex block masks padded to the
bin budget for branching bins, varlen boundaries for chains), but the hidden
states and logprobs are empty/zero tensors, so what is timed is the host's
own work. (Host work that only exists with a real model on a GPU -- the
Python dispatch of ~30 ops per decoder layer, kernel launches -- is not in
these numbers; the GPU run reports it indirectly through device busy.)

Two measurements per layout (exact, tree):
- `stages_cpu_ms_per_bin` (thread CPU time, robust to a loaded machine) and
  `stages_wall_ms_per_bin`: each stage run serially, timed alone (median of
  `--repeats` passes over the file);
- `engine`: the real local engine (`run_local`, background preparation, one
  window in flight) with the no-op model and an Arrow sink, as the CLI runs
  it: wall time, the process's CPU time and the main thread's CPU time, per bin.
Each is compared with the H200's device seconds per bin of the same run
(`bench/results/h200_bench_cli_gpu.json`: device_seconds / bins). `--moe`: the MoE bench's
data instead (bench_moe_gpu.py: routes of 4 MoE layers x top-8 of 128 experts on every token,
replayed), where the routes are most of the host's bytes.

    python bench/bench_host_cpu.py            # ~1 minute on 2 cores; JSON to bench/results/
    python bench/bench_host_cpu.py --moe --repeats 2   # ~3 minutes
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from treeflow.models import AttentionPlan, ModelConfig  # noqa: E402
from treeflow.pipeline import ArrowSink, Files, Pipeline  # noqa: E402
from treeflow.tools import synth_episodes, write_episodes
from treeflow.pipeline.local import run_local  # noqa: E402
from treeflow.pipeline.stats import bin_sums, episode_sums  # noqa: E402
from treeflow.stages import Forward, Fragment, Pack, Reassemble, Shard  # noqa: E402
from treeflow.ops.runner import ForwardRunner  # noqa: E402

QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2)


class NoopBackend:
    """The backend protocol with real CUDA-style attention plans and no model compute."""

    name = "reference"

    def __init__(self, config: ModelConfig, max_tokens: int):
        self.config, self.max_tokens = config, max_tokens
        self.device = torch.device("cpu")
        self.module = torch.nn.Linear(1, 1)

    def attention_plan(self, parents_N, subtree_end_N, *, kernel, pad_to=None):
        # what kernel="auto" builds on CUDA: flex padded to the budget for trees, varlen for chains
        if _branching(subtree_end_N):
            return AttentionPlan(subtree_end_N, kernel="flex", pad_to=self.max_tokens)
        return AttentionPlan(subtree_end_N, kernel="causal")

    def hidden_states(self, tokens_N, positions_N, plan, **routes):
        return torch.zeros(len(tokens_N), 0)  # [N, 0]: selecting edge rows costs nothing

    def edge_logprobs(self, hidden_EH, targets_E, *, chunk_size, with_entropy,
                      targets_checked=False):
        return torch.zeros(len(targets_E)), (torch.zeros(len(targets_E)) if with_entropy else None)

    def train(self, mode=True):
        pass


def _branching(end_N) -> bool:
    end_N = np.asarray(end_N)
    inner = end_N[:-1] > np.arange(1, len(end_N))
    return bool(np.any(inner & (end_N[1:] != end_N[:-1])))


def _stages(path, layout, max_tokens, window, runner, out_dir) -> tuple[dict, dict, int]:
    """CPU and wall seconds per stage over the whole file, each stage timed alone; bins."""
    cpu: dict = {}
    wall: dict = {}

    def timed(name, fn, *args, **kwargs):
        c0, w0 = time.thread_time(), time.perf_counter()
        r = fn(*args, **kwargs)
        cpu[name] = cpu.get(name, 0.0) + time.thread_time() - c0
        wall[name] = wall.get(name, 0.0) + time.perf_counter() - w0
        return r

    pack, frag, shard = Pack(layout=layout), Fragment(max_tokens=max_tokens), Shard()
    reasm = Reassemble()
    nbins = 0
    it = iter(Files(paths=(path,), episodes_per_step=window, vocab_size=runner.vocab_size))
    with ArrowSink(os.path.join(out_dir, f"stages-{layout}.arrow")) as sink:
        for step in range(10**9):
            episodes = timed("read_validate", next, it, None)
            if episodes is None:
                break
            lays = timed("pack", pack.map, episodes, step=step)
            bins = timed("fragment", frag.map, lays, step=step)
            bins = timed("shard", shard.map, bins, step=step)
            timed("window_sums", lambda: (episode_sums(episodes), bin_sums(bins)))
            prepared = timed("prepare_attention_plans_buffers", runner.prepare, bins)
            pending = timed("launch_loop_noop_model", runner.launch, prepared)
            values = timed("edge_values", pending.result)
            acc = timed("reassemble", reasm.open, episodes)
            timed("reassemble", acc.add, values)
            out = timed("reassemble", acc.finish)
            timed("write", sink.write, out)
            nbins += bins.num_rows
    return cpu, wall, nbins


def _engine(path, layout, max_tokens, window, runner, out_dir) -> dict:
    """The local engine end to end with the no-op model, results written as the CLI does."""
    pipe = Pipeline(Pack(layout=layout), Fragment(max_tokens=max_tokens), Shard(),
                    Forward(), Reassemble())
    from treeflow.pipeline.plan import Worker

    worker = Worker(pipe.plan, runner=runner)
    source = Files(paths=(path,), episodes_per_step=window, vocab_size=runner.vocab_size)
    bins = 0
    wall0, cpu0, main0 = time.perf_counter(), time.process_time(), time.thread_time()
    with ArrowSink(os.path.join(out_dir, f"engine-{layout}.arrow")) as sink:
        # as on CUDA: preparation in the background thread (run_local's CPU default is in line)
        kwargs = ({"background": True} if "background" in inspect.signature(run_local).parameters
                  else {})
        for rec in run_local(pipe.plan, iter(source), worker=worker, prefetch=2, **kwargs):
            sink.write(rec.output)
            bins += rec.stats["bins"]
    wall, cpu, main = (time.perf_counter() - wall0, time.process_time() - cpu0,
                       time.thread_time() - main0)
    return {"bins": bins, "wall_ms_per_bin": round(1000 * wall / bins, 2),
            "process_cpu_ms_per_bin": round(1000 * cpu / bins, 2),
            "main_thread_cpu_ms_per_bin": round(1000 * main / bins, 2),
            "wall_seconds": round(wall, 3)}


def _import_seconds() -> float:
    """Seconds to import treeflow's model code in a fresh interpreter (part of CLI start-up)."""
    code = ("import time, torch; t = time.perf_counter(); import treeflow.models; "
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    return round(float(out.stdout.strip().splitlines()[-1]), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu-results", default=os.path.join(HERE, "results", "h200_bench_cli_gpu.json"))
    ap.add_argument("--label", default="after", help="a name for this code version in the JSON")
    ap.add_argument("--out", default=None, help="default: results/cpu_host_per_bin.json, "
                    "with --moe results/cpu_host_per_bin_moe.json")
    ap.add_argument("--moe", action="store_true",
                    help="bench_moe_gpu.py's data: the 4-layer Qwen3-30B-A3B shape's routes "
                         "(4 MoE layers x top-8 of 128 experts a token) replayed, --routing replay")
    args = ap.parse_args()
    args.out = args.out or os.path.join(HERE, "results", "cpu_host_per_bin_moe.json" if args.moe
                                        else "cpu_host_per_bin.json")
    torch.set_num_threads(1)  # the host's work, not torch's intra-op threads
    work = tempfile.mkdtemp(prefix="treeflow-host-")
    path = os.path.join(work, "episodes.arrow")
    if args.moe:  # = treeflow synth --routes-from the checkpoint, bench_moe_gpu.py
        sys.path.insert(0, HERE)
        from bench_moe_gpu import shape

        config = ModelConfig.from_hf_dict(shape(4, False))
        routes = dict(routes=config.moe.top_k, route_layers=len(config.moe.moe_layers),
                      num_experts=config.moe.num_experts)
    else:  # = treeflow synth, bench_cli_gpu.py
        config, routes = ModelConfig(**QWEN2_05B), {}
    write_episodes(synth_episodes(episodes=args.episodes, group_size=8, turns=(3, 10),
                                  vocab_size=32000, seed=0, **routes), path)
    runner = ForwardRunner(Forward(routing="replay" if args.moe else "auto"),
                           NoopBackend(config, args.max_tokens))
    gpu = {}
    if os.path.exists(args.gpu_results):
        for shape, res in json.load(open(args.gpu_results))["shapes"].items():
            for layout in ("exact", "tree"):
                r = res.get(f"replay_{layout}")
                if isinstance(r, dict) and r.get("device_seconds"):
                    gpu.setdefault(layout, {})[shape] = round(1000 * r["device_seconds"] / r["bins"], 1)
    settings = {k: (os.path.relpath(v, ROOT) if k in ("gpu_results", "out") else v)
                for k, v in vars(args).items()}  # no machine paths in results
    result = {"label": args.label, "settings": settings, "torch_threads": 1,
              "loadavg_before": os.getloadavg(), "layouts": {}}
    for layout in ("exact", "tree"):
        passes = [_stages(path, layout, args.max_tokens, args.window, runner, work)
                  for _ in range(args.repeats)]
        nbins = passes[0][2]

        def per_bin(i):
            return {k: round(1000 * statistics.median(p[i][k] for p in passes) / nbins, 2)
                    for k in passes[0][i]}

        stages, stages_wall = per_bin(0), per_bin(1)
        engine = [_engine(path, layout, args.max_tokens, args.window, runner, work)
                  for _ in range(args.repeats)]
        best = min(engine, key=lambda e: e["wall_ms_per_bin"])
        row = {"bins": nbins, "stages_cpu_ms_per_bin": stages,
               "stages_cpu_total_ms_per_bin": round(sum(stages.values()), 2),
               "stages_wall_ms_per_bin": stages_wall,
               "stages_wall_total_ms_per_bin": round(sum(stages_wall.values()), 2),
               "engine": best, "engine_wall_ms_per_bin_all": [e["wall_ms_per_bin"] for e in engine],
               "h200_device_ms_per_bin": gpu.get(layout, {})}
        if gpu.get(layout):
            row["host_over_device"] = {s: round(best["process_cpu_ms_per_bin"] / ms, 3)
                                       for s, ms in gpu[layout].items()}
        result["layouts"][layout] = row
        print(json.dumps({layout: row}), flush=True)
    result["import_treeflow_models_seconds"] = _import_seconds()
    result["loadavg_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
