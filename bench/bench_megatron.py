"""Megatron-core backend vs the reference backend, and TP=2 vs TP=1, on the same tree bins.

Llama-3.2-1B shape (16 layers, hidden 2048, 32 query / 8 key-value heads,
MLP 8192, vocabulary 128256, tied), random seeded weights (both backends load
the same ModelConfig, hence the same weights), bf16, tree layout (compiled
FlexAttention), synthetic agentic episodes packed and fragmented once. Per
backend: forward-only logprobs over bins of `--max-tokens`, and
forward+backward (loss = -sum of the edges' logprobs) over bins of
`--train-max-tokens`; one warm-up pass (compiles flex), then `--repeats`
timed passes, median reported as executed tokens per second.

    python bench/bench_megatron.py            # TP=1 both backends, then TP=2 (torchrun, 2 GPUs)
    python bench/bench_megatron.py --tp 2     # only TP=2 (forward and forward+backward)
    python bench/bench_megatron.py --smoke    # tiny model and data, to check the setup
    python bench/bench_megatron.py --smoke --device cpu --dtype float32   # TP=2 over gloo

The parent process runs TP=1 (reference and megatron) and launches itself
under torchrun for each larger TP size in `--tp` (sequence parallel on GPUs;
skipped with a note when fewer GPUs are visible). A TP=T run's tokens/s is
that of its T GPUs together; `tokens_per_s_per_device` divides by T, and `tp_scaling` gives
TP=T's rate over TP=1's for each mode. Prints one JSON object; writes
$OUT/bench_megatron.json if OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore", module="megatron")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from treeflow.models import ModelConfig, load_backend  # noqa: E402
from treeflow.tools import synth_episodes  # noqa: E402
from treeflow.stages import Forward, Fragment, Pack  # noqa: E402
from treeflow.ops import build_forward

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
SMOKE = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def _bins(args, config, max_tokens):
    eps = synth_episodes(episodes=args.episodes, group_size=args.group_size,
                         vocab_size=config.vocab_size, seed=args.seed,
                         **({"turns": (2, 3), "system_tokens": 60, "user_tokens": (5, 20), "completion_tokens": (5, 20),
                             "tool_tokens": (5, 20)} if args.smoke else {}))
    return Fragment(max_tokens=max_tokens, pad_to_multiple=1)(Pack(layout="tree")(eps))


def _rows(bins):
    cols = ("tokens", "parents", "positions", "edge_sources", "edge_targets")
    lists = {c: bins.column(c).to_pylist() for c in cols}
    return [tuple(np.asarray(lists[c][r], dtype=np.int64) for c in cols)
            for r in range(bins.num_rows) if len(lists["edge_sources"][r])]


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats, device):
    fn()  # warm-up: compiles flex for this mode
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_backend(backend, args, fwd_rows, train_rows, devices: int = 1) -> dict:
    cuda = args.device == "cuda"
    runner = build_forward(Forward(model="tiny", backend=backend.name, dtype=args.dtype,
                     kernel="flex" if cuda else "runs", chunk_size=args.chunk_size
                     ), device=args.device, model=backend)

    def forward():
        with torch.no_grad():
            for row in fwd_rows:
                runner.edge_logprobs(*row)

    def train():
        backend.train(True)
        for row in train_rows:
            lp, _ = runner.edge_logprobs(*row)
            (-lp.sum()).backward()
        for _, p in backend.named_parameters():
            p.grad = None
        backend.train(False)

    out = {}
    for mode, fn, rows in (("forward", forward, fwd_rows), ("forward_backward", train, train_rows)):
        if mode == "forward_backward" and args.no_train:
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        seconds = _time(fn, args.repeats, args.device)
        tokens = sum(len(r[0]) for r in rows)
        out[mode] = {"bins": len(rows), "tokens": tokens, "seconds": round(seconds, 4),
                     "tokens_per_s": round(tokens / seconds), "devices": devices,
                     "tokens_per_s_per_device": round(tokens / seconds / devices)}
        if cuda:
            out[mode]["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    return out


def run(args, tp: int) -> dict:
    config = SMOKE if args.smoke else LLAMA_1B
    fwd_rows = _rows(_bins(args, config, args.max_tokens))
    train_rows = _rows(_bins(args, config, args.train_max_tokens))
    result = {}
    if tp == 1:
        ref = load_backend("reference", config, dtype=DTYPES[args.dtype], device=args.device)
        result["reference"] = bench_backend(ref, args, fwd_rows, train_rows)
        del ref
        if args.device == "cuda":
            torch.cuda.empty_cache()
    meg = load_backend("megatron", config, dtype=DTYPES[args.dtype], device=args.device,
                       tensor_parallel=tp)
    result[f"megatron_tp{tp}"] = bench_backend(meg, args, fwd_rows, train_rows, devices=tp)
    return result


def _without(argv: list[str], drop: dict[str, int]) -> list[str]:
    """argv without the options in `drop` (name -> how many values follow it)."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = drop[name] if "=" not in a else 0
            continue
        out.append(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=32768, help="bin size, forward-only")
    ap.add_argument("--train-max-tokens", type=int, default=16384, help="bin size, fwd+bwd")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=4096, help="edges per vocab chunk")
    ap.add_argument("--no-train", action="store_true", help="skip forward+backward")
    ap.add_argument("--no-tp2", action="store_true", help="skip TP > 1 (same as --tp 1)")
    ap.add_argument("--tp", default="1,2",
                    help="tensor-parallel sizes to run, comma-separated (1 includes the reference)")
    ap.add_argument("--smoke", action="store_true", help="tiny model and data, to check the setup")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to check the script (--smoke)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--worker-tp", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_megatron needs a CUDA device (--device cpu --smoke checks the script)")
    if args.worker_tp:  # one rank of the TP run, under torchrun
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        result = run(args, args.worker_tp)
        if torch.distributed.get_rank() == 0:
            with open(args.worker_out, "w") as f:
                json.dump(result, f)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return
    config = SMOKE if args.smoke else LLAMA_1B
    cuda = args.device == "cuda"
    result = {"model": dataclasses.asdict(config) | {"hf_extras": None}, "dtype": args.dtype,
              "layout": "tree", "kernel": "flex" if cuda else "runs",
              "device": torch.cuda.get_device_name() if cuda else "cpu",
              "args": {k: v for k, v in vars(args).items() if not k.startswith("worker")}}
    t0 = time.perf_counter()
    sizes = sorted({int(x) for x in args.tp.split(",")})
    if args.no_tp2:
        sizes = [1]
    if 1 in sizes:
        result.update(run(args, 1))
    for tp in (t for t in sizes if t > 1):
        key = f"megatron_tp{tp}"
        if cuda and torch.cuda.device_count() < tp:
            result[key] = {"skipped": f"needs {tp} GPUs, {torch.cuda.device_count()} visible"}
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, f"tp{tp}.json")
            passthrough = _without(sys.argv[1:], {"--no-tp2": 0, "--tp": 1})
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(tp), os.path.abspath(__file__), *passthrough,
                   "--worker-tp", str(tp), "--worker-out", out]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                result[key] = {"error": proc.stderr[-4000:]}
            else:
                with open(out) as f:
                    result.update(json.load(f))
    result["wall_seconds"] = round(time.perf_counter() - t0, 1)
    for mode in ("forward", "forward_backward"):
        base = result.get("reference", {}).get(mode, {}).get("tokens_per_s")
        one = result.get("megatron_tp1", {}).get(mode, {}).get("tokens_per_s")
        for tp in sizes:
            key = f"megatron_tp{tp}"
            rate = result.get(key, {}).get(mode, {}).get("tokens_per_s")
            if base and rate:
                result.setdefault("speedup_vs_reference", {})[f"{key}_{mode}"] = round(rate / base, 3)
            if tp > 1 and one and rate:
                result.setdefault("tp_scaling", {})[f"tp{tp}_{mode}"] = round(rate / one, 3)
    print(json.dumps(result, indent=1, default=float))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_megatron.json"), "w") as f:
            json.dump(result, f, indent=1, default=float)


if __name__ == "__main__":
    main()
