"""Where a bin spends its device time: torch.profiler tables for bench_moe_gpu.py and
bench_hybrid_gpu.py (any checkpoint; the MoE tables where the model has MoE blocks).

In the bench's own process (not through the CLI, whose process cannot be profiled from
outside): the checkpoint loaded as `treeflow replay` loads it, the first `--window` episodes
packed per layout (tree, exact) and fragmented at the bench's `--max-tokens`, and the
largest bin of each layout run once through the replay runner (routes replayed where the
model has experts; `--ssm-kernel` for a Mamba-2 hybrid's scan) under the
tuning `--tuning auto` picks for the device (on Hopper "fast": compiled layers, fused loss,
tuned flex tiles; `tuning` in the JSON). Then:

- `bin_forward`: that whole bin's forward (no grad), top ops by device time: how the MoE
  layers' ops weigh against attention and the rest;
- `bin_forward`'s `kernel_groups`: its device time by kind of kernel (expert grouped matmuls,
  attention, the Mamba-2 scan and conv kernels, other matmuls, compiled Triton kernels, copies
  and indexing, the rest), the table that says what of a bin is not the grouped matmuls or
  the scan;
- MoE models only: `moe_forward`: the first MoE layer alone (eager, not compiled), at the input and routes it saw in that bin
  (replayed, agreement counted, as in the run), forward in the bin's dtype;
- `moe_train`: the same layer as training runs it (float32 weights under bf16 autocast),
  forward + backward.

Each table lists the top aten ops (each op's own kernels) and the top device kernels (the
Triton kernels of compiled regions too) per call of the profiled region, with their share
of the total device time (the sum over kernels); `grouped_mm_share` is the expert grouped
matmuls' share (what the issue wants to be most of the MoE layer), `aten_share` the part
eager aten ops launched. Per-token numbers make tree and exact bins
(which differ in size) comparable. The trade-off: ops, not kernels, are named, so an op
that launches several kernels counts them together.

bench_moe_gpu.py runs it as a subprocess (its GPU memory is given back before the CLI runs),
and with --profile-before DIR once more with DIR's treeflow first on PYTHONPATH (a source
tree of the code before a change: the before/after table):

    python bench/bin_profile.py CKPT EPISODES --window 64 --max-tokens 32768 --out FILE \
        [--layouts tree,exact] [--ssm-kernel triton]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

TOP = 15


def _device_us(evt, device: str) -> float:
    names = ("self_cpu_time_total",) if device == "cpu" else ("self_device_time_total",
                                                               "self_cuda_time_total")
    for name in names:
        if hasattr(evt, name):
            return float(getattr(evt, name))
    return 0.0


def _table(prof, repeats: int, tokens: int, device: str) -> dict:
    """Ops (aten rows: each op's own kernels) and kernels (every device kernel, compiled
    regions' Triton kernels and library kernels included: the total device time)."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    ops = [(e.key, e.count, _device_us(e, device)) for e in events]
    ops = [r for r in ops if r[2] > 0 and r[0].startswith("aten::")]
    ops.sort(key=lambda r: -r[2])
    if device == "cpu":
        kernels, total = [], sum(r[2] for r in ops)
    else:
        kernels = [(e.key, e.count, _device_us(e, device)) for e in events
                   if e.device_type == DeviceType.CUDA]
        kernels = [r for r in kernels if r[2] > 0]
        kernels.sort(key=lambda r: -r[2])
        total = sum(r[2] for r in kernels) or sum(r[2] for r in ops)
    grouped = sum(r[2] for r in ops if "grouped_mm" in r[0])

    def rows(rs):
        return [{"name": k[:120], "calls": c // repeats, "ms": round(us / 1e3 / repeats, 3),
                 "share": round(us / total, 3)} for k, c, us in rs[:TOP]]

    return {"device_ms": round(total / 1e3 / repeats, 3),
            "device_us_per_token": round(total / repeats / max(tokens, 1), 4),
            "tokens": tokens,
            "grouped_mm_share": round(grouped / total, 3) if total else None,
            "aten_share": round(sum(r[2] for r in ops) / total, 3) if total else None,
            "top_ops": rows(ops), "top_kernels": rows(kernels)}


# kernel name fragments -> group (first match wins); names are CUDA kernels' as the profiler
# reports them: CUTLASS grouped GEMMs, FlexAttention's and FlashAttention's kernels, cuBLAS
# GEMMs, inductor's generated Triton kernels, torch's own gather/copy/sort kernels
_GROUPS = (("grouped_mm", ("grouped", "Grouped", "GroupProblem")),
           ("norms", ("_rms_norm",)),
           ("moe_fused", ("_swiglu_", "_combine_")),  # models/moe/triton_moe.py
           ("loss_fused", ("_loss_tile_",)),  # models/heads/triton_loss.py
           ("ssm_scan_conv", ("chunk_scan", "chunk_outer", "state_pass", "acs_", "_conv_", "conv1d",
                              "dx_bwd", "dc_bwd", "db_bwd", "token_x_bwd", "token_sum")),
           ("attention", ("flex", "flash", "fmha", "attention", "triton_tem")),
           ("matmul", ("gemm", "Gemm", "nvjet", "xmma", "cutlass", "sm90")),
           ("compiled_triton", ("triton_",)),
           ("sort_index_copy", ("sort", "Sort", "index", "Index", "gather", "scatter", "copy",
                                "Copy", "cat", "radix", "Radix", "cub")),
           )


def _kernel_groups(prof, repeats: int) -> dict:
    """Device ms per call of the region by kernel group (_GROUPS; "other" for the rest)."""
    from torch.autograd import DeviceType

    groups: dict = {}
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:
            continue
        us = _device_us(e, "cuda")
        name = next((g for g, keys in _GROUPS if any(k in e.key for k in keys)), "other")
        groups[name] = groups.get(name, 0.0) + us
    total = sum(groups.values()) or 1.0
    return {g: {"ms": round(us / 1e3 / repeats, 3), "share": round(us / total, 3)}
            for g, us in sorted(groups.items(), key=lambda kv: -kv[1])}


def _profiled(fn, repeats: int, tokens: int, device: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    fn()  # warm-up outside the profile
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                 ) as prof:
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
    table = _table(prof, repeats, tokens, device)
    if cuda:
        table["kernel_groups"] = _kernel_groups(prof, repeats)
    return table


def _largest_bin(runner, episodes, layout: str, max_tokens: int):
    from treeflow.stages import Fragment, Pack

    bins = Fragment(max_tokens=max_tokens)(Pack(layout=layout)(episodes))
    prepared = runner.prepare(bins)
    runner.wait_ready(prepared)
    items = [i for i in prepared.items if i is not None]
    return max(items, key=lambda i: i.num_tokens)


def bin_profile(ckpt: str, data: str, *, window: int, max_tokens: int, device: str = "cuda",
                repeats: int = 5, layouts: tuple[str, ...] = ("tree", "exact"),
                ssm_kernel: str | None = None) -> dict:
    """{layout: {bin_forward[, moe_forward, moe_train]}} tables (module docstring); on CPU
    (the bench's --smoke check) host time stands in for device time."""
    import torch

    from treeflow.models import load_model
    from treeflow.models.moe.block import MoeBlock
    from treeflow.models.tuning import Tuning, resolve_auto
    from treeflow.ops import build_forward
    from treeflow.schemas import read_episodes
    from treeflow.stages import Forward

    t0 = time.perf_counter()
    episodes = read_episodes(data).slice(0, window)
    cuda = device == "cuda"
    model = load_model(ckpt, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    tuning, why = resolve_auto("auto", device=device, model=ckpt)
    block = next((m for m in model.modules() if isinstance(m, MoeBlock)), None)
    routing = {"routing": "replay"} if block is not None else {}
    runner = build_forward(Forward(**routing, tuning=Tuning.parse(tuning, ssm_kernel=ssm_kernel)),
                           device=device, model=model, max_tokens=max_tokens)
    out: dict = {"tuning": tuning, "tuning_why": why, "ssm_kernel": ssm_kernel}
    seen: dict = {}

    def keep_input(module, args):
        seen["x"], seen["route"] = args[0].detach(), args[1]

    # training's float32 master weights of the first MoE layer
    train_block = None if block is None else copy.deepcopy(block).float()
    for layout in layouts:
        item = _largest_bin(runner, episodes, layout, max_tokens)
        n = item.num_tokens

        def bin_forward():
            with torch.no_grad():
                runner.run_bin(item)

        if block is None:
            out[layout] = {"bin_tokens": n,
                           "bin_forward": _profiled(bin_forward, repeats, n, device)}
            continue
        hook = block.register_forward_pre_hook(keep_input)
        bin_forward()  # compiles this layout's kernels, captures the MoE layer's input
        hook.remove()
        x_NH, route_NK = seen["x"], seen["route"]

        def moe_forward():
            with torch.no_grad():
                block(x_NH, route_NK, {}, True)

        def moe_train():
            x = x_NH.float().requires_grad_()
            with torch.autocast(device, dtype=torch.bfloat16):
                y = train_block(x, route_NK, {}, True)
            y.float().square().mean().backward()

        out[layout] = {"bin_tokens": n,
                       **{f.__name__: _profiled(f, repeats, n, device)
                          for f in (bin_forward, moe_forward, moe_train)}}
        train_block.zero_grad(set_to_none=True)
        runner.take_route_tally()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    del model, runner, block, train_block, seen
    if cuda:
        torch.cuda.empty_cache()
    return out


def run(ckpt: str, data: str, out: str, *, window: int, max_tokens: int, device: str,
        env: dict, timeout: float | None, tree: str | None = None,
        ssm_kernel: str | None = None) -> dict:
    """This script in a subprocess (the benches' way: its GPU memory is given back when it ends),
    with `tree`'s treeflow first on the path when given; its JSON, or {"error": ...}."""
    import os
    import subprocess
    import sys

    if tree is not None:
        env = {**env, "PYTHONPATH": os.pathsep.join([tree, env.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), ckpt, data, "--window", str(window),
             "--max-tokens", str(max_tokens), "--device", device, "--out", out,
             *(["--ssm-kernel", ssm_kernel] if ssm_kernel else [])],
            capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {e.timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("episodes")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layouts", default="tree,exact")
    ap.add_argument("--ssm-kernel", default=None, choices=("auto", "torch", "triton"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import treeflow

    res = bin_profile(args.model, args.episodes, window=args.window, max_tokens=args.max_tokens,
                      device=args.device, repeats=args.repeats,
                      layouts=tuple(args.layouts.split(",")), ssm_kernel=args.ssm_kernel)
    res["treeflow"] = os.path.relpath(treeflow.__file__)  # which tree ran (--profile-before)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
