"""MoE GPU benchmark: `treeflow replay` tree vs exact with routing replay, as a user runs it.

A random checkpoint of Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts,
top-8, moe_intermediate 768, 32 heads / 4 kv heads, head_dim 128, vocabulary
151936) with `--layers` layers (default 4, so it fits one GPU with AdamW),
bf16; 512 synthetic episodes in groups of 8 whose routes have the checkpoint's
shape (`treeflow synth --routes-from`). Every run is a subprocess of the CLI:

- `treeflow replay --layout exact|tree --routing replay`: steady seconds
  (wall - start-up - compile), the steady speedup tree over exact, the ideal
  token saving (exact-call tokens / executed tree tokens) and the share of it
  the speedup reaches; route_agreement (hashed synthetic routes, so low);
  `compile_seconds` on one compile cache, exact first: the tree run loads what
  exact built (bench_first_compile_gpu.py gives each layout a cache of its own);
- `--mode train --steps S` per layout: steady seconds per optimizer step;
- the work ideal: what the tree saves in FLOPs, not tokens. Both layouts' bins (Pack +
  Fragment at the run's --max-tokens, here in the bench process) counted with the cost model
  Shard balances by (stages/shard.py `CostModel.from_config`, exact pairs): per token the
  projections, router and top_k experts, per attention pair QK^T and PV, per loss edge the
  vocabulary projection. The token ideal (exact-call tokens / executed tree tokens) assumes
  all work shrinks with the tokens; the loss edges hardly shrink (each sampled token's
  logprob is computed once in either layout; the tree merges only duplicate samples) and the
  pairs shrink less, so at 4 layers and a
  151936-word vocabulary the work ideal is well under the token ideal. `share_of_work_ideal`
  is the measured speedup over it; `mfu_model` the model FLOPs (x3 in training, no
  recompute counted) per steady second over `--peak-tflops`;
- MFU on active parameters: 2 x active non-embedding parameters per token
  (attention + router + top_k experts; the vocabulary head runs only at loss
  edges and attention scores are not counted) x tokens / steady seconds /
  `--peak-tflops` (H200 dense bf16: 989), for forward (replay) and 6 x for
  training; both for executed tokens (what ran) and exact-call tokens (the
  work the tree layout stands in for);
- expert matmuls' achieved TFLOP/s: `models/moe/block.py`'s `expert_mix` (sort by
  expert, two grouped matmuls) alone on `--expert-tokens` tokens with random
  routes, forward and forward+backward, timed with CUDA events;
- `profile` (bench/bin_profile.py, unless --no-profile): torch.profiler tables of the
  largest tree and exact bin of the first window: the whole bin's forward, its first MoE
  layer forward, and that layer forward+backward as training runs it; top ops by device
  time, per token, and the grouped matmuls' share (a subprocess after the replay runs;
  `--profile-before DIR`: again with DIR's treeflow, e.g. a `git archive` of the base
  commit, as `profile_before`).

The JSON lands in $OUT/bench_moe_gpu.json (or bench/results). Without CUDA, --device cuda
prints a skip and exits 0. Training at --max-tokens 32768 peaked at 94 GB on an H200: on an
H100 (80 GB) give --train-max-tokens (16384) or --no-train.

    PYTHONUNBUFFERED=1 python bench/bench_moe_gpu.py                 # one H200, < 9 min
    PYTHONUNBUFFERED=1 python bench/bench_moe_gpu.py --train-max-tokens 16384 \
        --train-steps 2 --budget-seconds 290                         # one H100, ~5 min
    python bench/bench_moe_gpu.py --smoke --device cpu               # logic check, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_cli_gpu import cli  # noqa: E402  (one way to run the CLI and read its JSON)
import bin_profile  # noqa: E402  (bench/bin_profile.py: a bin's device time by kernel)


def shape(layers: int, smoke: bool) -> dict:
    if smoke:
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "norm_topk_prob": True}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "norm_topk_prob": True, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "router_aux_loss_coef": 0.001,
            "output_router_logits": False}


def active_params(c) -> int:
    """Non-embedding parameters one token runs through (attention, router, top_k experts)."""
    h, d = c.hidden_size, c.head_dim
    attn = h * d * (c.num_attention_heads * 2 + c.num_key_value_heads * 2) + 2 * d
    moe = c.moe
    per_layer = []
    for i in range(c.num_hidden_layers):
        if moe is not None and i in moe.moe_layers:
            mlp = h * moe.num_experts + moe.top_k * 3 * h * moe.moe_intermediate_size
        else:
            mlp = 3 * h * c.intermediate_size
        per_layer.append(attn + mlp + 2 * h)
    return sum(per_layer)


def expert_tflops(config, tokens: int, device: str, repeats: int, fused: bool | None = None
                  ) -> dict:
    """Achieved TFLOP/s of the expert matmuls (expert_mix, with the whole layer's memory passes)
    on random routes; fused: models/moe/triton_moe.py's SwiGLU and combine (None: as a run
    takes them, on CUDA)."""
    import torch

    from treeflow.models.moe.experts import expert_mix

    moe, h = config.moe, config.hidden_size
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, h, device=device, dtype=dtype, generator=g, requires_grad=True)
    gate_up = (0.02 * torch.randn(moe.num_experts, 2 * moe.moe_intermediate_size, h, device=device,
                                  dtype=dtype, generator=g)).requires_grad_()
    down = (0.02 * torch.randn(moe.num_experts, h, moe.moe_intermediate_size, device=device,
                               dtype=dtype, generator=g)).requires_grad_()
    idx = torch.rand(tokens, moe.num_experts, device=device, generator=g).topk(moe.top_k).indices
    w = torch.rand(tokens, moe.top_k, device=device, dtype=dtype, generator=g)
    flops = 2 * tokens * moe.top_k * 3 * h * moe.moe_intermediate_size  # gate+up and down

    def timed(fn) -> float:
        fn()  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(repeats):
                fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1000 / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats

    def fwd():
        with torch.no_grad():
            expert_mix(x, idx, w, gate_up, down, fused=fused)

    def fwd_bwd():
        expert_mix(x, idx, w, gate_up, down, fused=fused).float().square().mean().backward()

    from treeflow.models.moe.experts import _grouped_ok

    grouped = _grouped_ok(x, gate_up, down)
    f, fb = timed(fwd), timed(fwd_bwd)
    return {"tokens": tokens, "path": "grouped_mm" if grouped else "padded_bmm",
            "forward_seconds": round(f, 6), "forward_tflops": round(flops / f / 1e12, 2),
            "fwd_bwd_seconds": round(fb, 6), "fwd_bwd_tflops": round(3 * flops / fb / 1e12, 2)}


def work_flops(config, data: str, max_tokens: int, start: int = 0, stop: int | None = None) -> dict:
    """Forward FLOPs of episodes[start:stop] per layout as the CLI bins them (module docstring:
    the work ideal): tokens, exact attention pairs (sum of depth + 1), loss edges, and their
    FLOPs from stages/shard.py's cost model."""
    import numpy as np

    from treeflow.schemas import read_episodes
    from treeflow.stages import Fragment, Pack
    from treeflow.stages.flat import list_offsets
    from treeflow.stages.shard import CostModel, bin_costs

    episodes = read_episodes(data)
    episodes = episodes.slice(start, (stop or episodes.num_rows) - start)
    cost = CostModel.from_config(config, training=False, block=1)
    out = {}
    for layout in ("exact", "tree"):
        bins = Fragment(max_tokens=max_tokens)(Pack(layout=layout)(episodes))
        tokens = int(np.diff(list_offsets(bins.column("positions").combine_chunks())).sum())
        edges = int(np.diff(list_offsets(bins.column("edge_sources").combine_chunks())).sum())
        flops = float(bin_costs(bins, cost).sum())
        pairs = round((flops - cost.token * tokens - cost.edge * edges) / cost.pair)
        out[layout] = {"bins": bins.num_rows, "tokens": tokens, "pairs": pairs, "edges": edges,
                       "forward_flops": flops, "forward_tflop": round(flops / 1e12, 2),
                       "tflop_shares": {"tokens": round(cost.token * tokens / flops, 3),
                                        "pairs": round(cost.pair * pairs / flops, 3),
                                        "edges": round(cost.edge * edges / flops, 3)}
                       if flops else None}
    ex, tr = out["exact"], out["tree"]
    out["work_ideal"] = round(ex["forward_flops"] / tr["forward_flops"], 3) if tr["tokens"] else None
    out["token_ideal"] = round(ex["tokens"] / tr["tokens"], 3) if tr["tokens"] else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--train-max-tokens", type=int, default=None,
                    help="--max-tokens of the --mode train runs (default: --max-tokens)")
    ap.add_argument("--no-profile", action="store_true", help="skip bench/bin_profile.py")
    ap.add_argument("--profile-before", default=None, metavar="DIR",
                    help="also profile with DIR's treeflow (a source tree from before a change)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--expert-tokens", type=int, default=32768)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--budget-seconds", type=float, default=520)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and data (logic check)")
    args = ap.parse_args()
    if args.smoke:
        args.episodes, args.group_size, args.max_turns, args.max_tokens = 8, 2, 3, 8192
        args.window, args.train_batch, args.train_steps, args.expert_tokens = 4, 4, 2, 256
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "--device cuda and no CUDA device (use --smoke --device "
                                     "cpu for the logic check)"}))
        return
    from treeflow.models import ModelConfig, save_model
    from treeflow.models.checkpoint import seeded_decoder

    t_start = time.perf_counter()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    out_file = os.path.join(out_dir, args.out or ("bench_moe_gpu_smoke.json" if args.smoke
                                                  else "bench_moe_gpu.json"))
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, *site, os.environ.get("PYTHONPATH", "")])}
    config = ModelConfig.from_hf_dict(shape(args.layers, args.smoke))
    res: dict = {"settings": vars(args), "active_params": active_params(config)}

    def save():
        res["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        with open(out_file, "w") as f:
            json.dump(res, f, indent=1)

    def left() -> float:
        return args.budget_seconds - (time.perf_counter() - t_start)

    work = tempfile.mkdtemp(prefix="treeflow-moe-bench-")
    ckpt, data = os.path.join(work, "model"), os.path.join(work, "episodes.arrow")
    t0 = time.perf_counter()
    save_model(seeded_decoder(config, device=args.device,
                              dtype=torch.bfloat16 if args.device == "cuda" else torch.float32),
               ckpt)
    res["checkpoint_seconds"] = round(time.perf_counter() - t0, 1)
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", data, "--episodes",
                    str(args.episodes), "--group-size", str(args.group_size), "--vocab-size",
                    str(min(config.vocab_size, 32000)), "--min-turns", str(min(3, args.max_turns)),
                    "--max-turns", str(args.max_turns), "--routes-from", ckpt, "--seed", "0",
                    "--quiet"], check=True, env=env)
    train_tokens = args.train_max_tokens or args.max_tokens
    res["work"] = {"replay": work_flops(config, data, args.max_tokens)}
    if not args.no_train and args.train_steps > 1:  # the steady steps: the second to the last
        res["work"]["train_steady"] = work_flops(config, data, train_tokens, args.train_batch,
                                                 args.train_batch * args.train_steps)
    print(f"  work: {json.dumps(res['work'])}", flush=True)
    print(f"[{time.perf_counter() - t_start:.0f}s] expert matmuls", flush=True)
    repeats = 3 if args.smoke else 10
    res["expert_matmul"] = expert_tflops(config, args.expert_tokens, args.device, repeats)
    # the same layer with experts.py's eager SwiGLU and combine: what the fused kernels save
    res["expert_matmul_eager"] = expert_tflops(config, args.expert_tokens, args.device, repeats,
                                               fused=False)
    print(f"  {json.dumps(res['expert_matmul'])}\n  eager: "
          f"{json.dumps(res['expert_matmul_eager'])}", flush=True)
    save()
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the CLI subprocesses get the memory this process held
    profiles = [] if args.no_profile else [("profile", ROOT)] + (
        [("profile_before", os.path.abspath(args.profile_before))] if args.profile_before else [])
    common = ["--model", ckpt, "--device", args.device, "--dtype", dtype, "--routing", "replay",
              "--json"]
    n_active, peak = res["active_params"], args.peak_tflops * 1e12
    for mode in ("replay",) + (() if args.no_train else ("train",)):
        for layout in ("exact", "tree"):
            key = f"{mode}_{layout}"
            if left() < 30:
                res[key] = "skipped (time budget)"
                continue
            print(f"[{time.perf_counter() - t_start:.0f}s] {mode} --layout {layout}", flush=True)
            extra = (["--episodes-per-step", str(args.window), "-o", os.path.join(work, f"{layout}.arrow")]
                     if mode == "replay" else
                     ["--mode", "train", "--episodes-per-step", str(args.train_batch), "--steps",
                      str(args.train_steps), "--lr", "1e-6"])
            extra += ["--max-tokens", str(args.max_tokens if mode == "replay"
                                          else args.train_max_tokens or args.max_tokens)]
            r = res[key] = cli(["replay", data, "--layout", layout, *extra, *common], env, key,
                               timeout=left() - 10)
            if mode == "replay" and "error" not in r:
                s = r["steady_seconds"]
                r["mfu_executed"] = round(2 * n_active * r["executed_tokens"] / s / peak, 4)
                r["mfu_exact_equivalent"] = round(2 * n_active * r["exact_tokens"] / s / peak, 4)
                r["mfu_model"] = round(res["work"]["replay"][layout]["forward_flops"] / s / peak, 4)
            if mode == "train" and r.get("steady_seconds_per_step") and \
                    "train_steady" in res["work"]:
                r["mfu_model"] = round(3 * res["work"]["train_steady"][layout]["forward_flops"]
                                       / (args.train_steps - 1)
                                       / r["steady_seconds_per_step"] / peak, 4)
            print(f"  {json.dumps(r)[:500]}", flush=True)
            save()
        for key, tree in profiles if mode == "replay" else ():  # after the replay numbers
            if left() < 60:
                res[key] = "skipped (time budget)"
                continue
            print(f"[{time.perf_counter() - t_start:.0f}s] {key} ({tree})", flush=True)
            res[key] = bin_profile.run(ckpt, data, os.path.join(work, f"{key}.json"),
                                       window=args.window, max_tokens=args.max_tokens,
                                       device=args.device, env=env, timeout=left() - 30,
                                       tree=tree)
            print(f"  {json.dumps(res[key])[:800]}", flush=True)
            save()
    ex, tr = res.get("replay_exact"), res.get("replay_tree")
    if isinstance(ex, dict) and isinstance(tr, dict) and "error" not in ex and "error" not in tr:
        res["replay_speedup_steady"] = round(ex["steady_seconds"] / tr["steady_seconds"], 3)
        res["ideal_saving"] = round(tr["exact_tokens"] / tr["executed_tokens"], 3)
        res["share_of_ideal"] = round(res["replay_speedup_steady"] / res["ideal_saving"], 3)
        res["work_ideal"] = res["work"]["replay"]["work_ideal"]
        res["share_of_work_ideal"] = round(res["replay_speedup_steady"] / res["work_ideal"], 3)
    ex, tr = res.get("train_exact"), res.get("train_tree")
    if (isinstance(ex, dict) and isinstance(tr, dict) and ex.get("steady_seconds_per_step")
            and tr.get("steady_seconds_per_step")):
        res["train_step_speedup_steady"] = round(
            ex["steady_seconds_per_step"] / tr["steady_seconds_per_step"], 3)
        steady = res["work"].get("train_steady")
        if steady:
            res["train_token_ideal"] = steady["token_ideal"]
            res["train_work_ideal"] = steady["work_ideal"]
            res["train_share_of_ideal"] = round(res["train_step_speedup_steady"]
                                                / steady["token_ideal"], 3)
            res["train_share_of_work_ideal"] = round(res["train_step_speedup_steady"]
                                                     / steady["work_ideal"], 3)
        last = tr.get("last") or {}
        if last.get("perf/executed_tokens"):
            res["train_tree_mfu_executed"] = round(
                6 * n_active * last["perf/executed_tokens"] / tr["steady_seconds_per_step"] / peak, 4)
    save()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
