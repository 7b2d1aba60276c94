"""Every speed lever of models/tuning.py, on and off, in one GPU command (< 9 minutes on an H200).

Sections, in order of value (each is written to $OUT as soon as it is done, and
skipped once `--budget-s` is spent, so a run cut short still leaves results):

1. `matmul`: the bf16 matmul ceiling (8192^3) and the rates of the layer's own
   products at the bin sizes (does a 16k x 2048 x 8192 product reach it?).
2. `kernel`: bench_attn_kernel.py on the 1B head shape (tree FlexAttention
   under several tiles/kernel options vs cuDNN/flash/varlen on the exact
   calls); its fastest forward+backward flex configuration is the one the
   `flex` and `all` levers use below.
3. `models["llama-1.24b"]`: the 1.24B Llama shape in bf16 (random weights):
   exact and tree layouts, forward-only logprobs over `--max-tokens` bins and
   forward+backward over `--train-max-tokens` bins, for each lever
   configuration: base, flex (tuned tiles), compile (compiled layer parts),
   fused-loss, all (compile + fused loss + flex), all+recompute-mlp. Per
   layout and mode: median seconds, speedup vs exact under the same levers and
   its share of the ideal token ratio, model TFLOP/s, MFU against 989 TFLOP/s
   and against the measured ceiling, peak memory, and activation memory per
   token (peak during one bin's forward+backward above weights and gradients,
   divided by the bin's tokens); tree logprobs of each lever against base's.
4. `profile`: torch.profiler over one tree forward+backward step with the
   `all` levers: kernels by device time, written to $OUT/profile_tree_fwd_bwd.txt,
   and a summary by kind (matmul, flex attention, compiled/eager elementwise,
   loss) in the JSON.
5. `models["llama-8b-4layers"]`: four layers of Llama-3-8B's shape (vocabulary
   32000, so the head is small): per-layer-stack MFU, base vs all.
6. `kernel_8b`: the kernel benchmark on the 8B head shape.

    python bench/bench_gpu_levers.py             # one H200
    python bench/bench_gpu_levers.py --smoke     # tiny, on CPU or GPU: checks the script
    python bench/bench_gpu_levers.py --summarize bench/results/h200_bench_gpu_levers_*.json

Prints compact JSON to stdout; writes $OUT/bench_gpu_levers.json if OUT is set.
Legend: N nodes of a bin, E its loss edges.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import pyarrow.compute as pc
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attn_kernel  # noqa: E402
from bench_gpu import H200_BF16_DENSE_PEAK, LLAMA_1B, flop_counts  # noqa: E402

from treeflow.models import Decoder, ModelConfig, ReferenceBackend, Tuning  # noqa: E402
from treeflow.models.checkpoint import seeded_decoder  # noqa: E402
from treeflow.tools.synth import synth_episodes  # noqa: E402
from treeflow.stages import Fragment, Pack  # noqa: E402
from treeflow.stages.flat import list_offsets, list_values  # noqa: E402
from treeflow.ops.runner import PreparedBin  # noqa: E402
from treeflow.tree import subtree_end  # noqa: E402

LLAMA_8B_4 = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0, rms_norm_eps=1e-5)
SMOKE = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


class Run:
    def __init__(self, args, device):
        self.args, self.device, self.cuda = args, device, device.type == "cuda"
        self.t0 = time.perf_counter()
        self.timer = bench_attn_kernel.Timer(device, args.repeats)
        self.result = {"env": _env(), "settings": vars(args), "peak_flops": H200_BF16_DENSE_PEAK}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> bool:
        return self.elapsed() < self.args.budget_s

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():.0f}s] {msg}", file=sys.stderr, flush=True)

    def write(self) -> None:
        self.result["wall_s"] = round(self.elapsed(), 1)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "bench_gpu_levers.json"), "w") as f:
                json.dump(self.result, f, indent=1, default=float)

    def section(self, name, fn, *a, **kw):
        """Run fn and store what it returns (or its error) under `name` ("a/b": nested)."""
        *parents, leaf = name.split("/")
        where = self.result
        for p in parents:
            where = where.setdefault(p, {})
        if self.args.sections and name not in self.args.sections.split(","):
            return None
        if not self.left():
            where[leaf] = {"skipped": "time budget"}
            return None
        try:
            out = fn(*a, **kw)
        except Exception as e:  # keep what the other sections measured
            import traceback

            traceback.print_exc()
            out = {"error": f"{type(e).__name__}: {e}"[:800]}
        where[leaf] = out
        self.write()
        self.log(f"{name} done")
        return out


def _env() -> dict:
    env = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda)
    return env


def matmuls(run: Run, shapes) -> dict:
    """bf16 product rates (TFLOP/s): the 8192^3 ceiling and the layers' own (M, K, N)."""
    out = {}
    for m, k, n in [(8192, 8192, 8192), *shapes]:
        a = torch.randn(m, k, device=run.device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=run.device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        out[f"{m}x{k}x{n}"] = round(2 * m * k * n / run.timer(lambda: a @ b) / 1e12, 1)
    out["ceiling_tflops"] = out["8192x8192x8192"]
    return out


def build_model(config: ModelConfig, device, seed: int = 0) -> Decoder:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return seeded_decoder(config, device=device, dtype=dtype, seed=seed)


def data(run: Run, config: ModelConfig) -> dict:
    a = run.args
    synth = bench_attn_kernel.SMOKE_SYNTH if a.smoke else {}
    eps = synth_episodes(episodes=a.episodes, group_size=a.group_size, seed=a.seed,
                         vocab_size=config.vocab_size, **synth)
    calls = pc.list_flatten(eps.column("calls")).combine_chunks().field("token_ids")
    exact = int(pc.sum(pc.list_value_length(calls)).as_py())
    out = {"exact_call_tokens": exact, "bins": {}}
    for layout in ("exact", "tree"):
        packed = Pack(layout=layout, scope="group" if layout == "tree" else None)(eps)
        unique = int(pc.sum(pc.list_value_length(packed.column("tokens"))).as_py())
        out[f"ideal_ratio_{layout}"] = exact / unique
        for mode, budget in (("forward", a.max_tokens), ("forward_backward", a.train_max_tokens)):
            out["bins"][layout, mode] = (Fragment(max_tokens=budget)(packed), budget)
    return out


def prepare(run: Run, backend, bins, layout: str, budget: int) -> list[PreparedBin]:
    cols = {n: bins.column(n).combine_chunks() for n in
            ("tokens", "parents", "positions", "edge_sources", "edge_targets")}
    off = {n: list_offsets(c) for n, c in cols.items()}
    val = {n: list_values(c) for n, c in cols.items()}
    kernel = "flex" if layout == "tree" and run.cuda else "auto"
    out = []
    for r in range(bins.num_rows):
        get = {n: np.ascontiguousarray(val[n][off[n][r]:off[n][r + 1]], dtype=np.int64) for n in val}
        if not len(get["edge_sources"]):
            continue
        plan = backend.attention_plan(get["parents"], subtree_end(get["positions"]), kernel=kernel,
                                      pad_to=budget if run.cuda else None)
        dev = {n: torch.from_numpy(x).to(run.device) for n, x in get.items()}
        out.append(PreparedBin(dev["tokens"], dev["positions"], dev["edge_sources"],
                               dev["edge_targets"], plan, len(get["positions"])))
    return out


def forward_pass(backend, bins, chunk) -> list[torch.Tensor]:
    with torch.no_grad():
        return [backend.edge_logprobs(backend.hidden_states(b.tokens_N, b.positions_N, b.plan)[
            b.sources_E], b.targets_E, chunk_size=chunk, with_entropy=False,
            targets_checked=True)[0] for b in bins]


def train_step(backend, bins, chunk) -> None:
    backend.module.zero_grad(set_to_none=False)
    for b in bins:
        hidden_NH = backend.hidden_states(b.tokens_N, b.positions_N, b.plan)
        lp_E, _ = backend.edge_logprobs(hidden_NH[b.sources_E], b.targets_E, chunk_size=chunk,
                                        with_entropy=False, targets_checked=True)
        (-lp_E.sum()).backward()


def measure(run: Run, model, tuning: Tuning, d: dict, layout: str, mode: str, ceiling) -> dict:
    """One (levers, layout, mode): timings, rates, memory; `_logprobs` holds forward outputs."""
    backend = ReferenceBackend(model, tuning=tuning)
    table, budget = d["bins"][layout, mode]
    t0 = time.perf_counter()
    bins = prepare(run, backend, table, layout, budget)
    row = {"bins": len(bins), "plan_s": round(time.perf_counter() - t0, 3)}
    tokens = sum(b.num_tokens for b in bins)
    edges = sum(len(b.sources_E) for b in bins)
    pairs = sum(int((b.positions_N + 1).sum()) for b in bins)
    flops = flop_counts(model, tokens, edges, pairs)[mode]
    warm = bins if layout == "tree" else [bins[0], bins[-1]]
    chunk = run.args.chunk_size
    t0 = time.perf_counter()
    if mode == "forward":
        model.requires_grad_(False)
        forward_pass(backend, warm, chunk)
        _sync(run)
        row["warmup_s"] = round(time.perf_counter() - t0, 2)
        outs = []
        row["median_s"] = run.timer(lambda: outs.append(forward_pass(backend, bins, chunk)))
        row["_logprobs"] = [x.float().cpu() for x in outs[-1]]
    else:
        model.requires_grad_(True)
        train_step(backend, warm, chunk)
        _sync(run)
        row["warmup_s"] = round(time.perf_counter() - t0, 2)
        if run.cuda:  # activation memory of the largest bin, above weights and gradients
            big = max(bins, key=lambda b: b.num_tokens)
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            train_step(backend, [big], chunk)
            torch.cuda.synchronize()
            act = torch.cuda.max_memory_allocated() - base
            row["activation_bytes_per_token"] = round(act / big.num_tokens)
            row["activation_gib_largest_bin"] = round(act / 2**30, 2)
            row["largest_bin_tokens"] = big.num_tokens
            torch.cuda.reset_peak_memory_stats()
        row["median_s"] = run.timer(lambda: train_step(backend, bins, chunk))
        if run.cuda:
            row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        model.zero_grad(set_to_none=True)
        model.requires_grad_(False)
    s = row["median_s"]
    row.update(executed_tokens=tokens, edges=edges, executed_tokens_per_s=round(tokens / s),
               exact_call_tokens_per_s=round(d["exact_call_tokens"] / s),
               model_tflops=round(flops / s / 1e12, 1), mfu=round(flops / s / H200_BF16_DENSE_PEAK, 4))
    if ceiling:
        row["mfu_vs_ceiling"] = round(flops / s / 1e12 / ceiling, 4)
    return row


def levers(run: Run, config: ModelConfig, configs: dict, name: str) -> dict:
    """Every lever configuration on one model shape (see the module docstring)."""
    model = build_model(config, run.device, seed=run.args.seed)
    d = data(run, config)
    ceiling = (run.result.get("matmul") or {}).get("ceiling_tflops")
    out = {"model": {"params": sum(p.numel() for p in model.parameters()),
                     "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                     "vocab": config.vocab_size},
           "data": {k: v for k, v in d.items() if k != "bins"}, "configs": {}}
    run.result.setdefault("models", {})[name] = out  # written as it fills
    exact_rows, base_lp = {}, None
    for cname, (tuning, modes) in configs.items():
        rows = out["configs"][cname] = {"tuning": dataclasses.asdict(tuning)}
        for mode in modes:
            for layout in ("exact", "tree"):
                # flex settings do not touch the exact (varlen) layout: measured once per rest
                key = (dataclasses.replace(tuning, flex_block_size=128, flex_kernel_options=()), mode)
                if layout == "exact" and key in exact_rows:
                    rows[f"{layout}_{mode}"] = {"same_as": exact_rows[key][0]}
                    continue
                if not run.left():
                    rows[f"{layout}_{mode}"] = {"skipped": "time budget"}
                    continue
                try:
                    row = measure(run, model, tuning, d, layout, mode, ceiling)
                except Exception as e:
                    row = {"error": f"{type(e).__name__}: {e}"[:800]}
                    if run.cuda:
                        torch.cuda.empty_cache()
                lp = row.pop("_logprobs", None)
                if layout == "tree" and lp is not None:
                    if base_lp is None:
                        base_lp = lp
                    else:
                        row["tree_logprobs_max_abs_diff_vs_base"] = float(max(
                            (a - b).abs().max() for a, b in zip(lp, base_lp)))
                    row["tree_logprobs_finite"] = bool(all(torch.isfinite(a).all() for a in lp))
                if layout == "exact":
                    exact_rows[key] = (cname, row)
                rows[f"{layout}_{mode}"] = row
                run.log(f"{name} {cname} {layout} {mode}: {row.get('median_s', row)}")
            ex = exact_rows.get((dataclasses.replace(tuning, flex_block_size=128,
                                                     flex_kernel_options=()), mode), (None, {}))[1]
            tr = rows.get(f"tree_{mode}", {})
            if "median_s" in ex and "median_s" in tr:
                sp = ex["median_s"] / tr["median_s"]
                tr["speedup_vs_exact"] = round(sp, 3)
                tr["share_of_ideal"] = round(sp / d["ideal_ratio_tree"], 4)
        run.write()
    del model
    if run.cuda:
        torch.cuda.empty_cache()
    return out


def profile(run: Run, config: ModelConfig, tuning: Tuning) -> dict:
    """torch.profiler over one tree forward+backward step: device time by kernel and by kind."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    model = build_model(config, run.device, seed=run.args.seed)
    d = data(run, config)
    backend = ReferenceBackend(model, tuning=tuning)
    table, budget = d["bins"]["tree", "forward_backward"]
    bins = prepare(run, backend, table, "tree", budget)
    model.requires_grad_(True)
    train_step(backend, bins, run.args.chunk_size)  # warm (compiles)
    _sync(run)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    with prof(activities=acts) as p:
        train_step(backend, bins, run.args.chunk_size)
        _sync(run)
    events = p.key_averages()

    def dev_time(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    # device-side rows only (kernels, copies): a CPU op (aten::mm) or a Triton launch record
    # also carries its kernels' device time, and counting both would double it
    on_device = [e for e in events if dev_time(e) > 0
                 and str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1"))]
    kernels = sorted(((e.key, dev_time(e), e.count)
                      for e in (on_device or [e for e in events if dev_time(e) > 0])),
                     key=lambda x: -x[1])
    total = sum(t for _, t, _ in kernels) or 1
    kinds: dict[str, float] = {}
    for key, t, _ in kernels:
        kinds[_kind(key)] = kinds.get(_kind(key), 0) + t
    sort = "self_device_time_total" if run.cuda else "self_cpu_time_total"
    try:
        text = events.table(sort_by=sort, row_limit=40)
    except Exception:
        text = events.table(sort_by="self_cuda_time_total", row_limit=40)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_tree_fwd_bwd.txt"), "w") as f:
            f.write(f"tree forward+backward, {len(bins)} bins, tuning {tuning}\n\n{text}\n")
    del model, backend, bins
    if run.cuda:
        torch.cuda.empty_cache()
    return {"device_ms": round(total / 1e3, 1), "tuning": dataclasses.asdict(tuning),
            "by_kind_share": {k: round(v / total, 4) for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
            "top_kernels": [{"name": k[:120], "ms": round(t / 1e3, 2), "calls": c,
                             "share": round(t / total, 4)} for k, t, c in kernels[:25]]}


def _kind(name: str) -> str:
    n = name.lower()
    if "flex" in n or "triton_tem_fused" in n:
        return "flex_attention"
    if any(s in n for s in ("flash", "fmha", "cudnn")):
        return "flash_attention"
    if any(s in n for s in ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "matmul")):
        return "matmul"
    if n.startswith("triton_"):
        return "compiled_elementwise"
    if any(s in n for s in ("memcpy", "memset")):
        return "copies"
    if any(s in n for s in ("elementwise", "vectorized", "reduce", "unrolled", "cat", "index",
                            "scatter", "gather", "softmax", "exp", "log")):
        return "eager_elementwise"
    return "other"


def _sync(run: Run) -> None:
    if run.cuda:
        torch.cuda.synchronize()


def _compact(result: dict) -> dict:
    """The headline numbers: per model and lever, tree speedup share of ideal, MFU, memory."""
    out = {}
    for mname, m in (result.get("models") or {}).items():
        if not isinstance(m, dict) or "configs" not in m:
            continue
        for cname, rows in m["configs"].items():
            for mode in ("forward", "forward_backward"):
                tr, ex = rows.get(f"tree_{mode}", {}), rows.get(f"exact_{mode}", {})
                if "median_s" in tr:
                    # share_of_ideal = flop_ceiling x efficiency: the tree saves fewer FLOPs
                    # than tokens (a token still attends to its whole context), and runs them
                    # at tree_mfu / exact_mfu of the exact calls' rate
                    flops = (ex.get("model_tflops", 0) * ex.get("median_s", 0)
                             / (tr.get("model_tflops") or float("inf")) / tr["median_s"])
                    ideal = (m.get("data") or {}).get("ideal_ratio_tree")
                    out[f"{mname}/{cname}/{mode}"] = {
                        "flop_ratio": round(flops, 3) if flops else None,
                        "flop_ceiling": round(flops / ideal, 4) if flops and ideal else None,
                        "efficiency": (round(tr["mfu"] / ex["mfu"], 4)
                                       if tr.get("mfu") and ex.get("mfu") else None),
                        "tree_s": round(tr["median_s"], 4), "exact_s": ex.get("median_s"),
                        "share_of_ideal": tr.get("share_of_ideal"), "tree_mfu": tr.get("mfu"),
                        "tree_mfu_vs_ceiling": tr.get("mfu_vs_ceiling"),
                        "exact_mfu": ex.get("mfu"),
                        "act_bytes_per_token": tr.get("activation_bytes_per_token"),
                        "peak_gib": tr.get("peak_memory_gib")}
    return out


def summarize(paths: list[str]) -> str:
    """A markdown table of stored results (no GPU): one row per model, lever and mode."""
    lines = ["| file | model / levers / mode | tree s | exact s | share of ideal | FLOP ceiling | "
             "efficiency | tree MFU | exact MFU | peak GiB | activation bytes/token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path in paths:
        with open(path) as f:
            rows = _compact(json.load(f))
        for key, r in rows.items():
            cells = [r.get(k) for k in ("tree_s", "exact_s", "share_of_ideal", "flop_ceiling",
                                        "efficiency", "tree_mfu", "exact_mfu", "peak_gib",
                                        "act_bytes_per_token")]
            lines.append(f"| {os.path.basename(path)} | {key} | " + " | ".join(
                "" if c is None else f"{c:.4g}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:  # python bench/bench_gpu_levers.py --summarize FILE...
        print(summarize(sys.argv[2:]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--train-max-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--loss-vocab-chunk", type=int, default=32768)
    ap.add_argument("--budget-s", type=float, default=470, help="stop starting new work after this")
    ap.add_argument("--flex", default=None, help="flex configuration of bench_attn_kernel "
                    "(default: the kernel section's fastest forward+backward one)")
    ap.add_argument("--smoke", action="store_true", help="tiny model and data (CPU or GPU)")
    ap.add_argument("--sections", default="", help="run only these sections, comma-separated "
                    "(matmul, kernel, models/llama-1.24b, profile, models/llama-8b-4layers, "
                    "kernel_8b); give --flex when kernel is not among them")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("bench_gpu_levers.py: no CUDA device; --smoke checks the script on CPU", file=sys.stderr)
        raise SystemExit(0)
    if args.smoke:
        args.episodes, args.group_size, args.max_tokens, args.train_max_tokens = 4, 2, 1024, 512
        args.repeats, args.chunk_size, args.loss_vocab_chunk = 1, 16, 100
    run = Run(args, device)
    big = (SMOKE, SMOKE) if args.smoke else (LLAMA_1B, LLAMA_8B_4)
    if run.cuda:
        t = args.train_max_tokens
        run.section("matmul", matmuls, run, [(t, 2048, 8192), (t, 8192, 2048), (t, 2048, 3072),
                                              (t, 4096, 14336), (t, 14336, 4096)])
    kernel = run.section("kernel", bench_attn_kernel.run, shapes=("llama-1b",),
                         configs=("default", "bwd-64x64", "bwd-32x128", "bwd-w4"), smoke=args.smoke,
                         budget_s=args.budget_s / 3, log=run.log)
    flex = args.flex or ((kernel or {}).get("shapes", {}).get("llama-1b", {}).get("best_flex")
                         if kernel and "shapes" in kernel else None) or "default"
    tile, options = bench_attn_kernel.FLEX_CONFIGS[flex]
    flex_t = {"flex_block_size": tile, "flex_kernel_options": options}
    lv = {"loss_vocab_chunk": args.loss_vocab_chunk}
    compile_t = {"compile_layers": True}
    both = ("forward", "forward_backward")
    configs = {
        "base": (Tuning(), both),
        "all": (Tuning(**flex_t, **compile_t, fused_loss=True, **lv), both),
        "compile": (Tuning(**compile_t), both),
        "fused-loss": (Tuning(fused_loss=True, **lv), both),
        "flex": (Tuning(**flex_t), both),
        "all+recompute-mlp": (Tuning(**flex_t, **compile_t, fused_loss=True, recompute="mlp", **lv),
                              ("forward_backward",)),
    }
    run.result["flex_config"] = flex
    run.section("models/llama-1.24b", levers, run, big[0], configs, "llama-1.24b")
    run.section("profile", profile, run, big[0], configs["all"][0])
    eight = {k: configs[k] for k in ("base", "all")}
    run.section("models/llama-8b-4layers", levers, run, big[1], eight, "llama-8b-4layers")
    run.section("kernel_8b", bench_attn_kernel.run, shapes=("llama-8b",),
                configs=("default", flex) if flex != "default" else ("default",),
                smoke=args.smoke, budget_s=args.budget_s, log=run.log)
    run.result["summary"] = _compact(run.result)
    run.write()
    print(json.dumps({"summary": run.result["summary"], "flex_config": flex,
                      "matmul": run.result.get("matmul"), "wall_s": run.result["wall_s"],
                      "kernel_best": {s: {"flex": r.get("best_flex"), "exact": r.get("best_exact"),
                                          **{f"flex_{n}": x.get("fwd_bwd_tflops", x.get("fwd_tflops"))
                                             for n, x in r.get("flex", {}).items()},
                                          **{f"exact_{n}": x.get("fwd_bwd_tflops", x.get("fwd_tflops"))
                                             for n, x in r.get("exact", {}).items()}}
                                      for k in ("kernel", "kernel_8b")
                                      for s, r in ((run.result.get(k) or {}).get("shapes") or {}).items()},
                      "profile_by_kind": (run.result.get("profile") or {}).get("by_kind_share")},
                     indent=1, default=float))


if __name__ == "__main__":
    main()
