"""The Mamba-2 tree scan: fused Triton kernels (models/ssm/triton_scan.py) vs the PyTorch scan.

One Nemotron-H 1.3B-shaped Mamba-2 mixer (hidden 2048, 64 heads x 64, state 128,
8 groups, conv 4, scan chunk 128), bf16 weights and activations, float32 states,
run over the tree bins of synthetic agent episodes (Pack(layout="tree", scope="group")
-> Fragment(max_tokens), by default 128 episodes in bins of up to 32768 tokens, the
two largest timed, ~30k tokens each). Per part (`--parts`: the whole mixer; the tree
conv alone, SiLU(depthwise causal conv1d) over xBC, models/ssm/triton_conv.py for
triton; conv + scan, the mixer less its projections and norm), kernel and fork mode: forward and
forward+backward tokens/s (bin tokens / seconds, after warm-up), the first call's
seconds (`*_first_seconds`; for triton the kernels' compilation, which happens in
the first bin's first call of each pass; `first_call_seconds` in the summary),
peak CUDA memory above the inputs, and the outputs' and input gradient's distance
between the two kernels (a sanity line, not the correctness test: tests/models/ssm/test_ssm_triton.py
and tests/gpu/test_gpu_scan.py are). Prints one JSON object.

    PYTHONUNBUFFERED=1 python3 bench/bench_scan_gpu.py            # H100/H200
    python3 bench/bench_scan_gpu.py --precision bf16 --kernels torch,triton   # bf16 products
    python3 bench/bench_scan_gpu.py --kernels triton --num-warps 8    # launch settings, timed
    python3 bench/bench_scan_gpu.py --kernels triton --tile 32        #   (recorded as "launch")
    python bench/bench_scan_gpu.py --smoke --device cpu            # checks the logic (torch only)

Without CUDA (and without --device cpu) it prints {"skipped": ...} and exits 0. On CPU
the Triton kernel needs TRITON_INTERPRET=1 and is far too slow to time: --smoke --device
cpu times only the torch kernel unless --kernels names triton.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SHAPES = {
    "nemotron-h-1b": dict(hidden_size=2048, mamba_num_heads=64, mamba_head_dim=64,
                          ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128),
    "smoke": dict(hidden_size=64, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                  n_groups=2, conv_kernel=4, chunk_size=16),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shape and episodes")
    p.add_argument("--kernels", default=None, help="comma list of torch,triton "
                   "(default: both on CUDA, torch on CPU)")
    p.add_argument("--forks", default="chunk,exact")
    p.add_argument("--parts", default="mixer,conv,conv_scan",
                   help="comma list of mixer (the whole Mamba-2 mixer), conv (the tree conv "
                   "alone), conv_scan (conv + scan, no projections)")
    p.add_argument("--max-tokens", type=int, default=None, help="bin budget (default 32768)")
    p.add_argument("--episodes", type=int, default=None, help="synthetic episodes (default 128)")
    p.add_argument("--bins", type=int, default=None, help="bins timed (default 2)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="compute dtype (default bfloat16 on CUDA: the triton kernels' bf16 "
                   "products; float32: their ieee products)")
    p.add_argument("--precision", default="auto", choices=("auto", "ieee", "tf32x3", "bf16"),
                   help="the triton kernels' products (SegmentPlan scan_precision; default auto: "
                   "ieee for float32, bf16 for bfloat16: bf16 operands, float32 "
                   "accumulate and states)")
    p.add_argument("--num-warps", type=int, default=None,
                   help="the scan kernels' num_warps (default: triton_scan.LAUNCH's); e.g. 8 to "
                   "time the 64-wide tf32x3 tiles that spill registers at 4")
    p.add_argument("--tile", type=int, default=None, choices=(16, 32, 64, 128),
                   help="the scan kernels' largest tile edge, every precision (default: "
                   "triton_scan.BLOCKS)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--profile", action="store_true",
                   help="after timing, one forward and one forward+backward of each part under "
                   "torch.profiler: the top device ops by time into each row's 'profile'")
    return p.parse_args(argv)


def _bins(args):
    from treeflow.tools import synth_episodes
    from treeflow.stages import Fragment, Pack

    if args.smoke:
        eps = synth_episodes(episodes=args.episodes or 8, group_size=4, turns=(2, 4),
                             system_tokens=40, user_tokens=(5, 20), completion_tokens=(5, 20),
                             tool_tokens=(5, 30), branch_prob=0.3, vocab_size=500, seed=0)
    else:
        eps = synth_episodes(episodes=args.episodes or 128, seed=0)
    layouts = Pack(layout="tree", scope="group")(eps)
    bins = Fragment(max_tokens=args.max_tokens or (256 if args.smoke else 32768))(layouts)
    rows = sorted(bins.to_pylist(), key=lambda b: -len(b["parents"]))
    return [b["parents"] for b in rows[:args.bins or 2]]


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, repeats):
    """(seconds of the first call, which compiles the kernels; median seconds of fn() over
    repeats after it)."""
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t0
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return first, sorted(out)[len(out) // 2]


def run(args) -> dict:
    import numpy as np
    import torch

    from treeflow.models.config.hybrid import HybridConfig
    from treeflow.models.ssm.mamba import Mamba2Mixer
    from treeflow.models.ssm.tree import SegmentPlan

    device = torch.device(args.device)
    launch = _launch(args)
    shape = SHAPES["smoke" if args.smoke else "nemotron-h-1b"]
    cfg = HybridConfig.from_hf_dict({"architectures": ["NemotronHForCausalLM"], "vocab_size": 512,
                                     "intermediate_size": 96, "hybrid_override_pattern": "M",
                                     "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "head_dim": 16, **shape})
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(0)
    mixer = Mamba2Mixer(cfg).to(device=device, dtype=dtype)
    kernels = (args.kernels or ("torch,triton" if device.type == "cuda" else "torch")).split(",")
    parents = _bins(args)
    precision = None if args.precision == "auto" else args.precision
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "shape": shape, "dtype": str(dtype), "state_dtype": args.state_dtype,
              "bins": [len(p) for p in parents], "kernels": kernels, "launch": launch,
              "runs": []}
    for fork in args.forks.split(","):
        for i, par in enumerate(parents):
            par = np.asarray(par, dtype=np.int64)
            n = len(par)
            x = torch.randn(n, cfg.hidden_size, device=device, dtype=dtype)
            dy = torch.randn(n, cfg.hidden_size, device=device, dtype=dtype)
            xbc = torch.randn(n, mixer.conv_dim, device=device, dtype=dtype)
            dt = torch.randn(n, mixer.heads, device=device, dtype=dtype)
            for part in args.parts.split(","):
                outs = {}
                for kernel in kernels:
                    plan = SegmentPlan(par, chunk_size=cfg.chunk_size,
                                       conv_kernel=cfg.conv_kernel, fork=fork,
                                       state_dtype=args.state_dtype, device=device, kernel=kernel,
                                       scan_precision=precision if kernel == "triton" else None)
                    row = {"fork": fork, "bin": i, "tokens": n, "segments": plan.segments,
                           "levels": plan.launches, "kernel": kernel, "part": part}
                    if kernel == "triton":
                        from treeflow.models.ssm.triton_scan import precision_for

                        row["precision"] = precision or precision_for(dtype)
                    call, inp, grad = _part(part, mixer, plan, x, xbc, dt, dy)
                    _time_part(row, call, inp, grad, mixer, device, args.repeats, n)
                    if args.profile:
                        row["profile"] = _profile(call, inp, grad, mixer, device)
                    outs[kernel] = _values(call, inp, grad, mixer)
                    result["runs"].append(row)
                if len(outs) == 2:
                    (ya, ga), (yb, gb) = outs.values()
                    result["runs"][-1]["vs_torch"] = {
                        "y_rel": float((ya - yb).norm() / ya.norm()),
                        "dx_rel": float((ga - gb).norm() / ga.norm())}
    result["summary"] = _summary(result["runs"], kernels)
    return result


def _launch(args) -> dict:
    """The scan kernels' launch settings this run times (--num-warps, --tile set them for the
    process), as recorded in the result."""
    from treeflow.models.ssm import triton_scan

    if args.num_warps:
        triton_scan.LAUNCH["num_warps"] = args.num_warps
    if args.tile:
        triton_scan.BLOCKS.update({k: args.tile for k in triton_scan.BLOCKS})
    return {**triton_scan.LAUNCH, "largest_tile": dict(triton_scan.BLOCKS)}


def _part(part, mixer, plan, x, xbc, dt, dy):
    """(the part as a function of one input, that input, the output gradient for backward)."""
    import torch

    from treeflow.models.ssm.tree import tree_conv

    g = torch.Generator(device=x.device).manual_seed(1)
    if part == "mixer":
        return (lambda xi: mixer(xi, plan)), x, dy
    if part == "conv":
        return ((lambda xi: tree_conv(xi, mixer.conv1d.weight, mixer.conv1d.bias, plan)), xbc,
                torch.randn(xbc.shape, generator=g, device=x.device, dtype=xbc.dtype))
    if part == "conv_scan":
        return ((lambda xi: mixer._scan(xi, dt, plan, slice(None), mixer.groups)), xbc,
                torch.randn(x.shape[0], mixer.heads, mixer.head_dim, generator=g,
                            device=x.device))
    raise ValueError(f"bench_scan_gpu --parts {part!r}: choose from mixer, conv, conv_scan")


def _time_part(row, call, inp, grad, mixer, device, repeats, n):
    """Forward and forward+backward seconds, tokens/s and peak memory of one part into row."""
    import torch

    def fwd():
        with torch.no_grad():
            return call(inp)

    def fwd_bwd():
        xi = inp.detach().requires_grad_()
        call(xi).backward(grad)
        return xi.grad

    for name, fn in (("forward", fwd), ("forward_backward", fwd_bwd)):
        mixer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        first, sec = _time(fn, device, repeats)
        row[f"{name}_first_seconds"] = round(first, 3)
        row[f"{name}_seconds"] = round(sec, 5)
        row[f"{name}_tokens_per_s"] = round(n / sec, 1)
        if device.type == "cuda":
            row[f"{name}_peak_mib"] = round(
                (torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)
    mixer.zero_grad(set_to_none=True)


def _profile(call, inp, grad, mixer, device, top=25):
    """{forward, forward_backward: [[op name, device ms, calls], ...]}: the top ops by device
    time (self time, so nested ops are not counted twice) of one call after warm-up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = {}
    for name in ("forward", "forward_backward"):
        mixer.zero_grad(set_to_none=True)
        with profile(activities=acts) as prof:
            if name == "forward":
                with torch.no_grad():
                    call(inp)
            else:
                xi = inp.detach().requires_grad_()
                call(xi).backward(grad)
            _sync(device)
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))[:top]
        out[name] = [[e.key[:80], round(getattr(e, key, 0) / 1000, 3), e.count] for e in rows]
        out[name + "_total_ms"] = round(sum(getattr(e, key, 0) for e in prof.key_averages())
                                        / 1000, 3)
    mixer.zero_grad(set_to_none=True)
    return out


def _values(call, inp, grad, mixer):
    """The part's output and its input's gradient, float32, for the kernels' distance."""
    import torch

    with torch.no_grad():
        y = call(inp).float()
    xi = inp.detach().requires_grad_()
    call(xi).backward(grad)
    mixer.zero_grad(set_to_none=True)
    return y, xi.grad.float()


def _summary(runs, kernels) -> dict:
    """Per fork and part: total tokens / total seconds per kernel, and triton over torch."""
    out = {}
    for fork in sorted({r["fork"] for r in runs}):
        out[fork] = {}
        for part in dict.fromkeys(r["part"] for r in runs):
            per = {}
            for k in kernels:
                rs = [r for r in runs if (r["fork"], r["part"], r["kernel"]) == (fork, part, k)]
                tok = sum(r["tokens"] for r in rs)
                per[k] = {m: round(tok / sum(r[f"{m}_seconds"] for r in rs), 1)
                          for m in ("forward", "forward_backward")}
                per[k]["first_call_seconds"] = {m: rs[0][f"{m}_first_seconds"]
                                                for m in ("forward", "forward_backward")}
                peaks = [r.get("forward_backward_peak_mib") for r in rs]
                if all(p is not None for p in peaks):
                    per[k]["max_forward_backward_peak_mib"] = max(peaks)
            if {"torch", "triton"} <= per.keys():
                per["speedup"] = {m: round(per["triton"][m] / per["torch"][m], 2)
                                  for m in ("forward", "forward_backward")}
            out[fork][part] = per
    return out


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (use --smoke --device cpu to check the "
                                     "script's logic)"}))
        return 0
    kernels = args.kernels or ""
    if "triton" in kernels:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            print(json.dumps({"skipped": "triton is not installed: pip install "
                                         "'treeflow[triton]'"}))
            return 0
    print(json.dumps(run(args), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
