"""Tree attention kernel vs causal attention on the same tokens laid out as exact calls.

One real tree bin from the bench data (synthetic agentic episodes, Pack tree
scope group, Fragment into `--max-tokens` bins; the bin with most attended
pairs) is run through treeflow's FlexAttention plan (block mask from
`subtree_end`, padded to the bin budget, compiled) under several mask tiles
and kernel options, and the same tokens as exact calls (every root-to-leaf
path of the bin as its own causal sequence) through SDPA causal with the
cuDNN and FlashAttention backends (one call per path, key/value heads
expanded beforehand) and through varlen FlashAttention (treeflow's `causal`
kernel, one packed call).

Useful FLOPs count only visible (query, key) pairs, the same way for both:
4 * head_dim * query_heads per pair forward; forward+backward is 3.5x that
(FlashAttention's convention: backward = 2.5x forward). Tree pairs are
sum(depth + 1) over the bin's real tokens (padding is excluded); exact pairs
are sum L (L + 1) / 2 over the paths. A check compares the tree output at
every path's tokens with the exact layout's output on that path.

    python bench/bench_attn_kernel.py               # one H200: 1B and 8B head shapes (~2 min)
    python bench/bench_attn_kernel.py --smoke       # tiny, forward only on CPU: checks the script

Prints one JSON object; writes $OUT/bench_attn_kernel.json if OUT is set.
`run()` is also called by bench_gpu_levers.py.

Legend: N tokens of the bin, T tokens of the exact calls, Q query heads, K key/value heads,
D head dim, L padded length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import pyarrow.compute as pc
import torch
import torch.nn.functional as F

from treeflow.models import AttentionPlan
from treeflow.models.attention.tree import compiled_flex
from treeflow.tools.synth import synth_episodes
from treeflow.stages import Fragment, Pack
from treeflow.tree import subtree_end

SHAPES = {"llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128)}  # (Q, K, D)
# No ROWS_GUARANTEED_SAFE: with it a tree row whose first visited key block hides all its
# ancestors becomes NaN (H200, torch 2.11); Tuning refuses it.
FLEX_CONFIGS = {  # name: (mask tile, kernel options)
    "default": (128, {}),
    "fwd-n64": (128, {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64}),
    "bwd-w4": (128, {"bwd_num_warps": 4}),
    "tile64": (64, {"BLOCK_M": 64, "BLOCK_N": 64, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64,
                    "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32}),
    "tile256": (256, {}),
    # the backward kernel's tiles (Hopper's default for head_dim 64 is M1=64 N1=128 M2=128
    # N2=64, 3 stages, 8 warps), on top of fwd-n64
    "bwd-64x64": (128, {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 64,
                        "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 4, "bwd_num_stages": 3}),
    "bwd-32x128": (128, {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 32,
                         "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                         "bwd_num_warps": 4, "bwd_num_stages": 3}),
    "bwd-s2": (128, {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "bwd_num_stages": 2}),
    "tma": (128, {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "USE_TMA": True}),
}
EXACT_BACKENDS = ("cudnn", "flash", "varlen")


SMOKE_SYNTH = {"turns": (2, 3), "system_tokens": 32, "user_tokens": (8, 32),
               "completion_tokens": (8, 32), "tool_tokens": (8, 32)}


def tree_bin(*, episodes: int, group_size: int, seed: int, max_tokens: int, **synth) -> dict:
    """The bench bin with most attended pairs: positions, parents and its exact-call paths."""
    eps = synth_episodes(episodes=episodes, group_size=group_size, seed=seed, **synth)
    bins = Fragment(max_tokens=max_tokens)(Pack(layout="tree", scope="group")(eps))
    best = None
    for r in range(bins.num_rows):
        pos = np.asarray(bins.column("positions")[r].values, dtype=np.int64)
        if len(pos) and (best is None or (pos + 1).sum() > (best[0] + 1).sum()):
            best = (pos, np.asarray(bins.column("parents")[r].values, dtype=np.int64))
    pos, parents = best
    has_child = np.zeros(len(pos), dtype=bool)
    has_child[parents[parents >= 0]] = True
    paths = []
    for leaf in np.flatnonzero(~has_child):
        path, i = [], int(leaf)
        while i >= 0:
            path.append(i)
            i = int(parents[i])
        paths.append(np.array(path[::-1], dtype=np.int64))
    lengths = np.array([len(p) for p in paths], dtype=np.int64)
    return {"positions": pos, "parents": parents, "paths": paths, "max_tokens": max_tokens,
            "bins": bins.num_rows, "tree_tokens": len(pos), "tree_pairs": int((pos + 1).sum()),
            "exact_tokens": int(lengths.sum()), "exact_pairs": int((lengths * (lengths + 1) // 2).sum()),
            "calls": len(paths), "episodes": episodes, "group_size": group_size, "seed": seed,
            "exact_call_tokens_of_data": int(pc.sum(pc.list_value_length(pc.list_flatten(
                eps.column("calls")).combine_chunks().field("token_ids"))).as_py())}


class Timer:
    """Median wall time of a function: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.cuda, self.repeats = device.type == "cuda", repeats

    def __call__(self, fn) -> float:
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def run(*, shapes=("llama-1b", "llama-8b"), configs=tuple(FLEX_CONFIGS), episodes=32,
        group_size=8, seed=0, max_tokens=16384, repeats=5, smoke=False, budget_s=None,
        log=print) -> dict:
    """The micro-benchmark as a dict (see the module docstring)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    t_start = time.perf_counter()
    synth = {}
    if smoke:
        episodes, group_size, max_tokens, repeats, synth = 4, 2, 512, 1, SMOKE_SYNTH
        shapes = ("smoke",)
    b = tree_bin(episodes=episodes, group_size=group_size, seed=seed, max_tokens=max_tokens,
                 **synth)
    out = {"bin": {k: v for k, v in b.items() if k not in ("positions", "parents", "paths")},
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "flops": "useful pairs only; fwd 4*D*Q per pair, "
           "fwd+bwd 3.5x fwd", "shapes": {}}
    dtype = torch.bfloat16 if cuda else torch.float32
    for shape in shapes:
        heads, kv_heads, dim = SHAPES.get(shape, (4, 2, 16))
        res = out["shapes"][shape] = {"heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                                      "flex": {}, "exact": {}}
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(b["tree_tokens"], h, dim, device=device, dtype=dtype, generator=gen)
                   for h in (heads, kv_heads, kv_heads))
        per_pair = 4 * dim * heads
        timer = Timer(device, repeats)
        flex_out = None
        for name in configs:
            if budget_s is not None and time.perf_counter() - t_start > budget_s:
                res["flex"][name] = {"skipped": "time budget"}
                continue
            tile, options = FLEX_CONFIGS[name]
            try:
                res["flex"][name], o = _flex(b, q, k, v, tile, options, timer, per_pair, cuda)
                # a fast configuration that computes something else is no configuration
                res["flex"][name]["finite"] = bool(torch.isfinite(o).all())
                if flex_out is not None:
                    res["flex"][name]["max_abs_diff_vs_first"] = float((o - flex_out).abs().max())
                flex_out = o if flex_out is None else flex_out
            except Exception as e:  # one bad kernel configuration must not lose the others
                res["flex"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            log(f"[{time.perf_counter() - t_start:.0f}s] {shape} flex {name}: {res['flex'][name]}")
        for backend in EXACT_BACKENDS:
            try:
                res["exact"][backend], check = _exact(b, q, k, v, backend, timer, per_pair, cuda,
                                                      flex_out)
                if check is not None:
                    res["exact"][backend]["max_abs_diff_vs_tree"] = check
            except Exception as e:
                res["exact"][backend] = {"error": f"{type(e).__name__}: {e}"[:500]}
            log(f"[{time.perf_counter() - t_start:.0f}s] {shape} exact {backend}: "
                f"{res['exact'][backend]}")
        res["best_flex"] = _best(res["flex"])
        res["best_exact"] = _best(res["exact"])
        del q, k, v
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    return out


def _best(rows: dict) -> str | None:
    key = "fwd_bwd_tflops" if any("fwd_bwd_tflops" in r for r in rows.values()) else "fwd_tflops"
    ok = {n: r[key] for n, r in rows.items() if key in r and r.get("finite", True)}
    return max(ok, key=ok.get) if ok else None


def _flex(b, q, k, v, tile, options, timer, per_pair, cuda):
    t0 = time.perf_counter()
    plan = AttentionPlan(subtree_end(b["positions"]), kernel="flex", device=q.device,
                         block_size=tile, pad_to=b["max_tokens"], kernel_options=options or None)
    row = {"mask_tile": tile, "kernel_options": options, "padded_tokens": plan._padded,
           "mask_build_s": round(time.perf_counter() - t0, 4)}
    with torch.no_grad():
        t0 = time.perf_counter()
        o = plan(q, k, v)
        _sync(cuda)
        row["fwd_first_call_s"] = round(time.perf_counter() - t0, 2)  # compile included
        row["fwd_s"] = timer(lambda: plan(q, k, v))
    row["fwd_tflops"] = per_pair * b["tree_pairs"] / row["fwd_s"] / 1e12
    if cuda:  # the kernel alone, on inputs padded beforehand (no pad/slice copies)
        pad = plan._padded - b["tree_tokens"]
        # the plan's own layout (padded [L, A, D] seen as [1, A, L, D]): the same compiled kernel
        qp, kp, vp = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unsqueeze(0)
                      for x in (q, k, v))
        kernel = compiled_flex()
        with torch.no_grad():
            row["kernel_fwd_s"] = timer(lambda: kernel(qp, kp, vp, block_mask=plan._mask.block_mask,
                                                       enable_gqa=True, kernel_options=options or None))
        row["kernel_fwd_tflops"] = per_pair * b["tree_pairs"] / row["kernel_fwd_s"] / 1e12
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        grad = torch.randn_like(o)

        def step():
            plan(qg, kg, vg).backward(grad)

        t0 = time.perf_counter()
        step()
        _sync(cuda)
        row["fwd_bwd_first_call_s"] = round(time.perf_counter() - t0, 2)
        row["fwd_bwd_s"] = timer(step)
        row["fwd_bwd_tflops"] = 3.5 * per_pair * b["tree_pairs"] / row["fwd_bwd_s"] / 1e12
    return row, o


def _exact(b, q, k, v, backend, timer, per_pair, cuda, tree_out):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    paths = b["paths"]
    idx = torch.from_numpy(np.concatenate(paths)).to(q.device)
    qx, kx, vx = (x.index_select(0, idx) for x in (q, k, v))  # [T, A, D], calls packed
    bounds = np.concatenate([[0], np.cumsum([len(p) for p in paths])]).tolist()
    row = {}
    if backend == "varlen":
        ends = np.repeat(bounds[1:], np.diff(bounds))
        plan = AttentionPlan(ends, kernel="causal", device=q.device)
        if not cuda:
            return {"skipped": "varlen FlashAttention runs on CUDA"}, None

        def fwd(qx=qx, kx=kx, vx=vx):
            return plan(qx, kx, vx)
    else:
        if not cuda:
            if backend != "cudnn":
                return {"skipped": "CUDA backend"}, None
            kind = SDPBackend.MATH  # the CPU smoke test runs the same loop through math
        else:
            kind = SDPBackend.CUDNN_ATTENTION if backend == "cudnn" else SDPBackend.FLASH_ATTENTION
        groups = q.shape[1] // k.shape[1]
        calls = [tuple(x[a:c].transpose(0, 1).unsqueeze(0).contiguous()
                       for x in (qx, kx.repeat_interleave(groups, 1), vx.repeat_interleave(groups, 1)))
                 for a, c in zip(bounds[:-1], bounds[1:])]
        row["kv_heads_expanded"] = True

        def fwd(calls=calls):
            with sdpa_kernel(kind):
                return [F.scaled_dot_product_attention(*c, is_causal=True) for c in calls]
    with torch.no_grad():
        outs = fwd()
        row["fwd_s"] = timer(fwd)
    row["fwd_tflops"] = per_pair * b["exact_pairs"] / row["fwd_s"] / 1e12
    packed = outs if backend == "varlen" else torch.cat([o[0].transpose(0, 1) for o in outs])
    check = None
    if tree_out is not None:
        check = float((packed.float() - tree_out.index_select(0, idx).float()).abs().max())
    if cuda:
        if backend == "varlen":
            leaves = [x.detach().requires_grad_() for x in (qx, kx, vx)]
            grad = torch.randn_like(packed)

            def step():
                fwd(*leaves).backward(grad)
        else:
            leaves = [[x.detach().requires_grad_() for x in c] for c in calls]
            grads = [torch.randn_like(o) for o in outs]

            def step():
                with sdpa_kernel(kind):
                    for c, g in zip(leaves, grads):
                        F.scaled_dot_product_attention(*c, is_causal=True).backward(g)
        step()
        row["fwd_bwd_s"] = timer(step)
        row["fwd_bwd_tflops"] = 3.5 * per_pair * b["exact_pairs"] / row["fwd_bwd_s"] / 1e12
    return row, check


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", default=",".join(FLEX_CONFIGS))
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: forward only)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_attn_kernel.py: no CUDA device; run with --smoke to check the script on CPU",
              file=sys.stderr)
        raise SystemExit(0)
    result = run(shapes=args.shapes.split(","), configs=args.configs.split(","),
                 episodes=args.episodes, group_size=args.group_size, seed=args.seed,
                 max_tokens=args.max_tokens, repeats=args.repeats, smoke=args.smoke,
                 log=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=1, default=float))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_attn_kernel.json"), "w") as f:
            json.dump(result, f, indent=1, default=float)


if __name__ == "__main__":
    main()
