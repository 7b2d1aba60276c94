"""GPU throughput of the exact, chain and tree layouts on a ~1B Llama-shaped model.

One CUDA device, bf16, random (seeded) weights, synthetic agentic episodes.
Per layout: Pack -> Fragment into bins of `--max-tokens` nodes -> forward-only
logprobs (edge selection before the vocabulary projection, as Forward does);
then a forward+backward step over bins of `--train-max-tokens` (loss = -sum of
the edges' logprobs, backward through the whole model, gradients accumulated
over the bins; the reference decoder keeps ~2 MB of activations per token).
Exact and chain bins run the causal (varlen FlashAttention) kernel, tree bins
compiled FlexAttention; every flex bin is padded to its bin budget, so one
compiled kernel and one mask shape serve all bins of a mode. Attention plans (block masks,
cu_seqlens) are built once per bin before timing and timed on their own.

Timing: a warm-up over the first and last bin of each layout (every bin of
the tree layout: compiles flex forward and backward), then `--repeats` full passes
timed with CUDA events; the median is reported. Model FLOPs are counted on the
tokens a layout executes: 2 (forward) or 6 (forward+backward) x the decoder's
linear parameters per token, the same for the vocabulary head per loss edge,
plus 4 (or 12) x head_dim x heads x layers per attended (query, key) pair,
i.e. per token its depth + 1. MFU divides by a stated dense bf16 peak.
"Exact-equivalent" rates divide the exact layout's work by a layout's time.

    python bench/bench_gpu.py                       # the full run (one H200, ~80 s)
    python bench/bench_gpu.py --smoke               # tiny sizes, to check the setup

Prints one JSON object (and a table to stderr); writes $OUT/bench_gpu.json if
OUT is set.

Legend: N nodes of a bin, E its loss edges, H hidden size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn

from treeflow.models import AttentionPlan, Decoder, ModelConfig, selected_logprobs
from treeflow.models.checkpoint import seeded_decoder
from treeflow.tools.synth import synth_episodes
from treeflow.stages import Fragment, Pack, Reassembly
from treeflow.stages.forward import edge_values_table
from treeflow.tree import subtree_end

LAYOUTS = ("exact", "chain", "tree")
H200_BF16_DENSE_PEAK = 989.4e12  # FLOP/s, NVIDIA datasheet, dense bf16 (SXM)

# Llama-3.2-1B's shape (tied embeddings): 1.24B parameters.
LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
# Qwen2-0.5B's shape (tied embeddings, q/k/v biases): 0.49B parameters.
QWEN2_05B = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True,
                        tie_word_embeddings=True, architecture="Qwen2ForCausalLM")
SHAPES = {"llama-3.2-1b": LLAMA_1B, "qwen2-0.5b": QWEN2_05B}
SMOKE = ModelConfig(vocab_size=128256, hidden_size=512, intermediate_size=1024,
                    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                    rope_theta=500000.0, tie_word_embeddings=True)


@dataclass
class _Bin:
    tokens_N: torch.Tensor
    positions_N: torch.Tensor
    sources_E: torch.Tensor
    targets_E: torch.Tensor
    plan: AttentionPlan
    num_tokens: int
    pairs: int
    edges: int


def _lists(bins: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    col = bins.column(name).combine_chunks()
    off = col.offsets.to_numpy()
    return off - off[0], pc.list_flatten(col).to_numpy(zero_copy_only=False)


def prepare_bins(bins: pa.Table, *, kernel: str, pad_to: int) -> tuple[list[_Bin], float]:
    """Device tensors and attention plans of every bin; returns them and the plan time (s)."""
    cols = {n: _lists(bins, n) for n in ("tokens", "parents", "positions", "edge_sources",
                                          "edge_targets")}

    def get(n, r, dtype=np.int64):
        off, val = cols[n]
        return np.ascontiguousarray(val[off[r]:off[r + 1]], dtype=dtype)

    def cuda(x):
        return torch.from_numpy(x).to("cuda", non_blocking=False)

    out, plan_s = [], 0.0
    for r in range(bins.num_rows):
        pos = get("positions", r)
        if len(get("edge_sources", r)) == 0:
            continue  # padding bins carry no edges
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = AttentionPlan(subtree_end(pos), kernel=kernel, device="cuda",
                             parents_N=get("parents", r), pad_to=pad_to)
        torch.cuda.synchronize()
        plan_s += time.perf_counter() - t0
        out.append(_Bin(cuda(get("tokens", r)), cuda(pos), cuda(get("edge_sources", r)),
                        cuda(get("edge_targets", r)), plan, len(pos), int((pos + 1).sum()),
                        len(get("edge_sources", r))))
    return out, plan_s


def forward_pass(model: Decoder, bins: list[_Bin], chunk_size: int) -> list[torch.Tensor]:
    with torch.no_grad():
        outs = []
        for b in bins:
            hidden_NH = model(b.tokens_N, b.positions_N, b.plan)
            lp_E, _ = selected_logprobs(model, hidden_NH[b.sources_E], b.targets_E,
                                        chunk_size=chunk_size)
            outs.append(lp_E)
        return outs


def train_step(model: Decoder, bins: list[_Bin], chunk_size: int) -> None:
    model.zero_grad(set_to_none=False)
    for b in bins:
        hidden_NH = model(b.tokens_N, b.positions_N, b.plan)
        lp_E, _ = selected_logprobs(model, hidden_NH[b.sources_E], b.targets_E,
                                    chunk_size=chunk_size)
        (-lp_E.sum()).backward()


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def flop_counts(model: Decoder, tokens: int, edges: int, pairs: int) -> dict:
    c = model.config
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, nn.Linear))
    head = c.vocab_size * c.hidden_size
    per_pair = 4 * c.head_dim * c.num_attention_heads * c.num_hidden_layers
    fwd = 2 * linear * tokens + 2 * head * edges + per_pair * pairs
    return {"forward": fwd, "forward_backward": 3 * fwd,
            "attention_share": per_pair * pairs / fwd}


def matmul_ceiling() -> float:
    """bf16 8192^3 matrix product rate on random data (TFLOP/s), median of 10 after 3 warm-ups."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = timed(lambda: a @ b, 10)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def reassembled(episodes: pa.Table, bins: pa.Table, logprobs: list[torch.Tensor]) -> np.ndarray:
    """Per-occurrence logprobs in the episodes' logical order (raises if any is lost or doubled)."""
    keep = [r for r in range(bins.num_rows) if len(bins.column("edge_sources")[r]) > 0]
    buf = Reassembly(episodes)
    buf.add(edge_values_table(bins.take(keep), [x.float().cpu().numpy() for x in logprobs], None))
    assert buf.missing == 0
    return buf.logprobs_S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=32768, help="bin size, forward-only")
    ap.add_argument("--train-max-tokens", type=int, default=16384,
                    help="bin size for forward+backward (activations: ~2 MB per token)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=4096, help="edges per vocab-projection chunk")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--no-train", action="store_true", help="skip forward+backward")
    ap.add_argument("--smoke", action="store_true", help="tiny model and data, to check the setup")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="token ids of the synthetic episodes (default: the model's vocabulary)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    config = SHAPES[args.shape]
    if args.smoke:
        config, args.episodes, args.group_size = SMOKE, 4, 2
        args.max_tokens, args.train_max_tokens, args.repeats = 8192, 4096, 1
    train_tokens = args.train_max_tokens
    layouts = args.layouts.split(",")
    t_start = time.perf_counter()

    episodes = synth_episodes(episodes=args.episodes, group_size=args.group_size,
                              vocab_size=args.vocab_size or config.vocab_size, seed=args.seed)
    call_lens = pc.list_value_length(
        pc.list_flatten(episodes.column("calls")).combine_chunks().field("token_ids"))
    exact_tokens = int(pc.sum(call_lens).as_py())
    packed = {name: Pack(layout=name, scope="group" if name == "tree" else None)(episodes)
              for name in layouts}
    unique = {name: int(pc.sum(pc.list_value_length(lay.column("tokens"))).as_py())
              for name, lay in packed.items()}

    model = seeded_decoder(config, device="cuda", dtype=torch.bfloat16, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    dev = torch.cuda.get_device_properties(0)
    result = {
        "env": {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": dev.name,
                "sms": dev.multi_processor_count, "python": sys.version.split()[0],
                "cudnn": torch.backends.cudnn.version()},
        "model": {"params": n_params, "hidden": config.hidden_size,
                  "layers": config.num_hidden_layers, "heads": config.num_attention_heads,
                  "kv_heads": config.num_key_value_heads,
                  "intermediate": config.intermediate_size, "vocab": config.vocab_size,
                  "dtype": "bfloat16", "tied_embeddings": config.tie_word_embeddings},
        "data": {"episodes": args.episodes, "group_size": args.group_size, "seed": args.seed,
                 "calls": len(call_lens), "exact_call_tokens": exact_tokens,
                 "sampled_tokens": None,
                 **{f"{k}_unique_tokens": v for k, v in unique.items()},
                 **{f"ideal_ratio_{k}": exact_tokens / v for k, v in unique.items()}},
        "settings": {"max_tokens": args.max_tokens, "train_max_tokens": train_tokens,
                     "repeats": args.repeats, "chunk_size": args.chunk_size,
                     "peak_flops": H200_BF16_DENSE_PEAK,
                     "peak_note": "H200 SXM dense bf16 datasheet 989.4 TFLOP/s"},
        "matmul_ceiling_tflops": round(matmul_ceiling(), 1),
        "layouts": {},
    }
    if "tree" in unique and unique["tree"] and exact_tokens / unique["tree"] < 4:
        print(f"warning: ideal tree ratio {exact_tokens / unique['tree']:.2f} < 4", file=sys.stderr)

    logprobs_S = {}
    for name in layouts:
        try:
            result["layouts"][name] = _layout(name, model, episodes, packed[name], exact_tokens,
                                              train_tokens, args, logprobs_S)
        except Exception as e:  # keep what the other layouts measured
            result.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            print(f"{name} failed: {e!r}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        _write(result)
        print(f"[{time.perf_counter() - t_start:.0f}s] {name} done", file=sys.stderr, flush=True)
    _summarise(result, logprobs_S, unique, exact_tokens)
    from torch._dynamo.utils import counters
    result["dynamo_counters"] = {k: dict(v) for k, v in counters.items()
                                 if k in ("stats", "recompiles", "graph_break")}
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result, indent=1, default=float))
    _write(result)
    _table(result)


def _layout(name, model, episodes, layouts, exact_tokens, train_tokens, args, logprobs_S) -> dict:
    """Plans, forward-only and forward+backward timings of one layout."""
    kernel = "flex" if name == "tree" else "auto"
    bins = Fragment(max_tokens=args.max_tokens)(layouts)
    fwd_bins, plan_s = prepare_bins(bins, kernel=kernel, pad_to=args.max_tokens)
    tokens = sum(b.num_tokens for b in fwd_bins)
    edges = sum(b.edges for b in fwd_bins)
    pairs = sum(b.pairs for b in fwd_bins)
    flops = flop_counts(model, tokens, edges, pairs)
    row = {"kernels": sorted({b.plan.kernel for b in fwd_bins}), "bins": len(fwd_bins),
           "executed_tokens": tokens, "edges": edges, "attended_pairs": pairs,
           "repeated_tokens": int(pc.sum(bins.column("repeated_tokens")).as_py() or 0),
           "plan_build_s": round(plan_s, 4), "attention_flop_share": flops["attention_share"]}

    t0 = time.perf_counter()
    forward_pass(model, _warmup(fwd_bins), args.chunk_size)
    torch.cuda.synchronize()
    row["forward_warmup_s"] = round(time.perf_counter() - t0, 2)
    outs = []
    times = timed(lambda: outs.append(forward_pass(model, fwd_bins, args.chunk_size)),
                  args.repeats)
    logprobs_S[name] = reassembled(episodes, bins, outs[-1])
    del outs
    fwd_s = statistics.median(times)
    row["forward"] = {"median_s": fwd_s, "times_s": times,
                      "exact_call_tokens_per_s": exact_tokens / fwd_s,
                      "executed_tokens_per_s": tokens / fwd_s,
                      "model_tflops": flops["forward"] / fwd_s / 1e12,
                      "mfu": flops["forward"] / fwd_s / H200_BF16_DENSE_PEAK}

    if not args.no_train:
        try:
            row["forward_backward"] = _train(model, layouts, kernel, exact_tokens, train_tokens,
                                             args)
        except Exception as e:  # an OOM here should not lose the forward numbers
            row["forward_backward"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name} forward+backward failed: {e!r}", file=sys.stderr, flush=True)
        model.zero_grad(set_to_none=True)
    return row


def _train(model, layouts, kernel, exact_tokens, train_tokens, args) -> dict:
    """Forward+backward of one layout's step, over bins of `train_tokens` nodes."""
    tbins = Fragment(max_tokens=train_tokens)(layouts)
    train_bins, _ = prepare_bins(tbins, kernel=kernel, pad_to=train_tokens)
    t_tokens = sum(b.num_tokens for b in train_bins)
    t_flops = flop_counts(model, t_tokens, sum(b.edges for b in train_bins),
                          sum(b.pairs for b in train_bins))
    model.requires_grad_(True)
    t0 = time.perf_counter()
    train_step(model, _warmup(train_bins), args.chunk_size)
    torch.cuda.synchronize()
    warmup_s = round(time.perf_counter() - t0, 2)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times = timed(lambda: train_step(model, train_bins, args.chunk_size), args.repeats)
    step_s = statistics.median(times)
    return {
        "median_s": step_s, "times_s": times, "bins": len(train_bins), "warmup_s": warmup_s,
        "executed_tokens": t_tokens,
        "exact_call_tokens_per_s": exact_tokens / step_s,
        "executed_tokens_per_s": t_tokens / step_s,
        "model_tflops": t_flops["forward_backward"] / step_s / 1e12,
        "mfu": t_flops["forward_backward"] / step_s / H200_BF16_DENSE_PEAK,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def _warmup(bins: list[_Bin]) -> list[_Bin]:
    """Bins to run before timing: all of a flex layout (few; any compile shows here), else two."""
    return bins if bins[0].plan.kernel == "flex" else [bins[0], bins[-1]]


def _write(result: dict) -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_gpu.json"), "w") as f:
            json.dump(result, f, indent=1, default=float)


def _summarise(result: dict, logprobs_S: dict, unique: dict, exact_tokens: int) -> None:
    base = result["layouts"].get("exact")
    for name, row in result["layouts"].items():
        row["ideal_ratio"] = exact_tokens / unique[name]
        row["executed_ratio"] = (base["executed_tokens"] / row["executed_tokens"]) if base else None
        if base:
            for mode in ("forward", "forward_backward"):
                if "median_s" in row.get(mode, {}) and "median_s" in base.get(mode, {}):
                    sp = base[mode]["median_s"] / row[mode]["median_s"]
                    row[mode]["speedup_vs_exact"] = sp
                    row[mode]["share_of_ideal"] = sp / row["ideal_ratio"]
                    # exact layout's FLOPs delivered per second by this layout
                    row[mode]["exact_equivalent_tflops"] = (
                        base[mode]["model_tflops"] * base[mode]["median_s"] / row[mode]["median_s"])
        if base and name != "exact":
            diff = np.abs(logprobs_S[name].astype(np.float64) - logprobs_S["exact"])
            row["logprob_vs_exact"] = {"max_abs_diff": float(diff.max()),
                                       "mean_abs_diff": float(diff.mean()),
                                       "occurrences": len(diff)}
    if "exact" in logprobs_S:
        lp = logprobs_S["exact"]
        result["data"]["sampled_tokens"] = len(lp)
        result["exact_logprobs"] = {"mean": float(lp.mean()), "std": float(lp.std())}


def _table(result: dict) -> None:
    head = (f"{'layout':6} {'kernel':7} {'ideal':>5} {'exec':>8} {'fwd s':>7} {'fwd tok/s':>10} "
            f"{'fwd x':>5} {'f+b s':>7} {'f+b x':>5} {'%ideal':>6} {'mfu':>5} {'peakGiB':>7}")
    lines = [head]
    for name, r in result["layouts"].items():
        f, t = r["forward"], r.get("forward_backward", {})
        lines.append(
            f"{name:6} {','.join(r['kernels']):7} {r['ideal_ratio']:5.2f} "
            f"{r['executed_tokens']:8d} {f['median_s']:7.3f} {f['exact_call_tokens_per_s']:10.0f} "
            f"{f.get('speedup_vs_exact', 0):5.2f} {t.get('median_s', 0):7.3f} "
            f"{t.get('speedup_vs_exact', 0):5.2f} {100 * t.get('share_of_ideal', 0):6.1f} "
            f"{t.get('mfu', 0):5.3f} {t.get('peak_memory_gib', 0):7.1f}")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
