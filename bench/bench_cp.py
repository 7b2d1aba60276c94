"""Context parallelism for trees: K/V moved vs an all-gather, and repeated context vs CP=1.

Synthetic long agent episodes (groups of 4, 10 calls each growing to about 64k tokens at
`--scale 1`; every length is multiplied by `--scale`) are packed as group trees. Planning
only, no model:

- per context-parallel size C and per-rank budget B: the bins Fragment plans with a
  budget of C x B, their repeated context (tokens run again because a tree was cut into
  fragments), or the error when a path does not fit (CP=1 with B below the longest call);
- per bin, the cuts of models/attention/context_parallel.py: rows each rank receives per layer
  (its first node's ancestors) against what an all-gather of the bin's K/V would deliver
  to it (N - n_r), the attention-cost imbalance (max / mean - 1 of pairs per rank), and
  the most tokens and keys one rank holds.

`--run` also runs one bin forward and backward on C spawned processes (gloo on cpu, NCCL
with `--device cuda`, one GPU each) with the tiny model (or `--model DIR`), next to C=1:
seconds per step, the largest logprob difference and the bytes exchanged per layer.

`--overlap` times one attention layer (forward + backward, random q/k/v of
`--attn-shape`) on the first bin and on a chain of `--chain` tokens, per C: the K/V
exchange blocking (exchange, then one call over all keys) against overlapped (own keys
while the exchange is in flight, received part merged by log-sum-exp), and the exchange
alone (forward and reverse). `hidden_share_of_exchange` is (blocking - overlapped) /
exchange alone: 1 when the exchange is hidden entirely and the split costs nothing,
negative when the split costs more than the exchange it hides; on a loaded CPU, where the
exchange is a fraction of a percent of the layer, it is noise. `exposed_share_of_exchange`
(CPU) is the host time the overlapped layer spent blocked in the exchange's waits over
the exchange alone: 0 when it is all hidden. Best of `--repeats`
(interleaved), slowest rank; `loadavg` says how loaded the machine was.

    python bench/bench_cp.py --scale 0.05 --run           # CPU check (a minute)
    python bench/bench_cp.py                               # planning at full scale
    python bench/bench_cp.py --scale 0.25 --run --device cuda --cp 2 --dtype bfloat16
    python bench/bench_cp.py --scale 0.01 --cp 2 --overlap --chain 4096 --repeats 5
    python bench/bench_cp.py --scale 0.25 --cp 2 --overlap --chain 65536 --device cuda \
        --dtype bfloat16 --attn-shape 32,8,128 --repeats 10
    python bench/bench_cp.py --smoke --device cpu         # checks the script

Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from treeflow.models.attention.context_parallel import cp_bounds, exchange_stats  # noqa: E402
from treeflow.parallel import ParallelDims  # noqa: E402
from treeflow.tools.synth import synth_episodes  # noqa: E402
from treeflow.stages import Fragment, Pack  # noqa: E402
from treeflow.stages.flat import list_offsets, list_values  # noqa: E402


def episodes(scale: float, groups: int, seed: int = 0):
    def s(x):
        return max(1, int(round(x * scale)))

    return synth_episodes(episodes=4 * groups, group_size=4, turns=(10, 10),
                          system_tokens=s(2500), user_tokens=(s(400), s(800)),
                          completion_tokens=(s(1000), s(3000)), tool_tokens=(s(2500), s(5400)),
                          branch_prob=0.0, vocab_size=32000, seed=seed)


def plan_row(layouts, size: int, budget: int) -> dict:
    row = {"context_parallel": size, "rank_budget": budget, "bin_budget": size * budget}
    try:
        bins = Fragment(max_tokens=size * budget)(layouts)
    except ValueError as e:
        return {**row, "refused": str(e).split(";")[0]}
    pos = bins.column("positions").combine_chunks()
    off, val = list_offsets(pos), list_values(pos).astype(np.int64)
    recv = ag = 0
    imbalance, most_tokens, most_keys, ratios = [], 0, 0, []
    for r in range(bins.num_rows):
        depths = val[off[r]:off[r + 1]]
        bounds = cp_bounds(depths, size)
        st = exchange_stats(depths, bounds)
        recv += int(st["recv_rows"].sum())
        ag += int(st["allgather_rows"].sum())
        if st["allgather_rows"].sum():
            ratios.append(st["recv_rows"].sum() / st["allgather_rows"].sum())
        pairs = st["pairs"].astype(np.float64)
        imbalance.append(float(pairs.max() / pairs.mean() - 1.0) if pairs.mean() else 0.0)
        tokens = np.diff(bounds)
        most_tokens = max(most_tokens, int(tokens.max()))
        most_keys = max(most_keys, int((tokens + st["recv_rows"]).max()))
    executed = int(off[-1])
    repeated = int(np.sum(bins.column("repeated_tokens").to_numpy()))
    row.update(bins=bins.num_rows, executed_tokens=executed, repeated_tokens=repeated,
               repeated_share=round(repeated / max(executed, 1), 4))
    if size > 1:
        row.update(exchanged_rows_per_layer=recv, allgather_rows_per_layer=ag,
                   exchanged_vs_allgather=round(recv / ag, 4) if ag else 0.0,
                   exchanged_vs_allgather_worst_bin=round(max(ratios, default=0.0), 4),
                   cost_imbalance_mean=round(float(np.mean(imbalance)), 4),
                   cost_imbalance_max=round(float(np.max(imbalance)), 4),
                   most_tokens_per_rank=most_tokens, most_keys_per_rank=most_keys)
    return row


def _rank_run(model: str, size: int, eps, bin_budget: int, device: str, dtype: str,
              repeats: int):
    """In each spawned rank: one bin forward+backward (warm-up, then timed) and its logprobs."""
    import torch

    from treeflow.stages import Forward, Loss, Reduce
    from treeflow.train import DataParallel, Trainer

    dp = DataParallel.from_env(device, dims=ParallelDims(cp=size))
    fwd = Forward(model=model, dtype=dtype)  # the context parallelism is dp's group's
    tr = Trainer(fwd, Reduce(loss=Loss(kind="nll", norm="token")), dp=dp)
    bins = Fragment(max_tokens=bin_budget)(Pack(scope="group")(eps)).slice(0, 1)
    values = tr.logprobs(bins)
    seconds = []
    for _ in range(repeats + 1):
        step = tr.open_step(eps)
        if dp.device.type == "cuda":
            torch.cuda.synchronize(dp.device)
        t0 = time.perf_counter()
        step.add(bins)
        if dp.device.type == "cuda":
            torch.cuda.synchronize(dp.device)
        seconds.append(time.perf_counter() - t0)
        step.abort()
    stats = tr.runner.take_stats() if size > 1 else None
    out = {"seconds": min(seconds[1:]), "tokens": int(bins.column("tokens").combine_chunks()
                                                       .value_lengths().to_numpy()[0]),
           # a tensor: the launcher reads rank results weights-only (no numpy arrays)
           "logprobs": torch.tensor(np.concatenate(values.column("edge_logprobs").to_pylist()))}
    if stats is not None:
        calls = repeats + 1  # every step ran the bin once (logprob phases are not counted)
        out["exchange_bytes_per_layer"] = (stats["recv_bytes"] // calls).tolist()
        out["allgather_bytes_per_layer"] = (stats["allgather_bytes"] // calls).tolist()
    if dp.device.type == "cuda":
        out["peak_mib"] = round(torch.cuda.max_memory_allocated(dp.device) / 2**20, 1)
    dp.close()
    return out


def run_rows(args, eps, bin_budget: int) -> list[dict]:
    """The same first bin (of `bin_budget` tokens) on 1 process and on each C of --cp."""
    from treeflow.train.launch import spawn

    rows, base = [], None
    for size in [1, *args.cp]:
        t0 = time.perf_counter()
        ranks = spawn(_rank_run, size, args.model, size, eps, bin_budget, args.device, args.dtype,
                      args.repeats, timeout_s=args.timeout)
        r0 = ranks[0]
        r0["logprobs"] = r0["logprobs"].numpy()
        row = {"context_parallel": size, "bin_tokens": r0["tokens"],
               "step_seconds": round(max(r["seconds"] for r in ranks), 4),
               "wall_seconds": round(time.perf_counter() - t0, 1)}
        if base is None:
            base = r0["logprobs"]
        elif len(base) == len(r0["logprobs"]):
            row["max_logprob_diff_vs_cp1"] = float(np.abs(r0["logprobs"] - base).max())
        if "exchange_bytes_per_layer" in r0:
            row["exchange_bytes_per_layer"] = r0["exchange_bytes_per_layer"]
            row["allgather_bytes_per_layer"] = r0["allgather_bytes_per_layer"]
        if "peak_mib" in r0:
            row["peak_mib"] = [r["peak_mib"] for r in ranks]
        rows.append(row)
    return rows


def _rank_overlap(size: int, parents, shape: tuple, kernel: str, device: str, dtype: str,
                  repeats: int) -> dict:
    """In each spawned rank: one attention layer (forward + backward) of this rank's range of
    the bin `parents`, with the K/V exchange blocking and overlapped, interleaved `repeats`
    times, and the exchange alone; per-repeat seconds (the caller takes the best)."""
    import torch
    import torch.distributed as dist

    from treeflow.models.attention import cp_exchange
    from treeflow.models.attention.context_parallel import ContextParallelPlan
    from treeflow.train import DataParallel
    from treeflow.tree import depths_from_parents

    dp = DataParallel.from_env(device, dims=ParallelDims(cp=size))
    cp, dev = dp.cp, torch.device(dp.device)
    heads, kv_heads, dim = shape
    parents = np.asarray(parents, dtype=np.int64)
    depths = depths_from_parents(parents)
    bounds = cp_bounds(depths, size)
    a, b = int(bounds[cp.rank]), int(bounds[cp.rank + 1])
    g = torch.Generator(device=dev).manual_seed(cp.rank)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b - a, h, dim, generator=g, device=dev, dtype=dt).requires_grad_(True)
               for h in (heads, kv_heads, kv_heads))
    plans = {mode: ContextParallelPlan(parents, depths, bounds, cp, kernel=kernel, device=dev,
                                       overlap=mode == "overlapped")
             for mode in ("blocking", "overlapped")}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier(group=cp.group)

    def layer(plan):
        out = plan(q, k, v)
        out.backward(torch.ones_like(out))

    def exchange_only():  # forward and reverse exchange, no attention
        plan = plans["blocking"]
        kv = torch.cat((k, v), dim=1).detach().requires_grad_(True)
        recv = cp_exchange.exchange(kv, plan._send_idx, plan.send_splits, plan.recv_splits,
                                    cp.group)
        recv.backward(torch.ones_like(recv))

    waited = []  # host seconds spent in the overlapped exchange's waits (gloo: exposed time)
    wait = cp_exchange.Pending.wait

    def timed_wait(self):
        t0 = time.perf_counter()
        wait(self)
        waited.append(time.perf_counter() - t0)

    cp_exchange.Pending.wait = timed_wait
    runs = {"blocking": lambda: layer(plans["blocking"]),
            "overlapped": lambda: layer(plans["overlapped"]), "exchange_only": exchange_only}
    seconds = {name: [] for name in runs}
    for name, fn in runs.items():  # warm-up (flex compiles on CUDA)
        fn()
    for _ in range(repeats):
        for name, fn in runs.items():
            sync()
            waited.clear()
            t0 = time.perf_counter()
            fn()
            sync()
            seconds[name].append(time.perf_counter() - t0)
            if name == "overlapped":
                seconds.setdefault("overlapped_waits", []).append(sum(waited))
    plan = plans["overlapped"]
    out = {"seconds": seconds, "received_rows": int(plan._received),
           "row_bytes": 2 * kv_heads * dim * q.element_size(), "queries": b - a}
    dp.close()
    return out


def overlap_rows(args, bin_parents: dict) -> list[dict]:
    """Per bin (name -> parents) and C of --cp: one layer's fwd+bwd seconds, blocking vs
    overlapped exchange (best of --repeats, slowest rank), and the exchange alone."""
    from treeflow.train.launch import spawn

    rows = []
    for name, parents in bin_parents.items():
        for size in args.cp:
            ranks = spawn(_rank_overlap, size, size, parents, args.attn_shape, args.attn_kernel,
                          args.device, args.dtype, args.repeats, timeout_s=args.timeout)
            best = {m: max(min(r["seconds"][m]) for r in ranks) for m in ranks[0]["seconds"]}
            saved = best["blocking"] - best["overlapped"]
            rows.append({"bin": name, "context_parallel": size, "tokens": len(parents),
                         "kernel": args.attn_kernel, "shape": list(args.attn_shape),
                         "received_rows": [r["received_rows"] for r in ranks],
                         "exchanged_mib": round(sum(r["received_rows"] * r["row_bytes"]
                                                    for r in ranks) / 2**20, 2),
                         **{f"{m}_seconds": round(t, 5) for m, t in best.items()},
                         "hidden_share_of_exchange": round(saved / best["exchange_only"], 3)
                         if best["exchange_only"] > 0 else None,
                         # host seconds blocked in the overlapped exchange's two waits (forward,
                         # backward): what of it stayed exposed. On CUDA a wait only orders
                         # streams, so this is ~0 there and says nothing
                         "exposed_share_of_exchange": round(best["overlapped_waits"]
                                                            / best["exchange_only"], 3)
                         if best["exchange_only"] > 0 and args.device == "cpu" else None,
                         "loadavg": list(os.getloadavg())})
    return rows


def _first_bin_parents(eps, budget: int) -> np.ndarray:
    bins = Fragment(max_tokens=budget)(Pack(scope="group")(eps)).slice(0, 1)
    return np.asarray(bins.column("parents").combine_chunks().values.to_numpy(), np.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every token count")
    p.add_argument("--groups", type=int, default=2, help="groups of 4 episodes")
    p.add_argument("--cp", default="2,4", help="context-parallel sizes (besides 1)")
    p.add_argument("--run", action="store_true", help="also run one bin on spawned ranks")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default="tiny")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=None)
    p.add_argument("--overlap", action="store_true",
                   help="also time one attention layer with the K/V exchange blocking vs "
                        "overlapped (the first bin and a chain of --chain tokens)")
    p.add_argument("--chain", type=int, default=4096, help="tokens of the --overlap chain")
    p.add_argument("--attn-shape", default="8,8,64", help="--overlap: heads,kv_heads,head_dim")
    p.add_argument("--attn-kernel", default=None, help="--overlap kernel (default: runs on "
                   "cpu, flex on cuda)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script "
                   "(--run and --overlap) in a minute or two, on --device cpu too")
    args = p.parse_args()
    if args.smoke:
        args.scale, args.chain, args.repeats, args.attn_shape = 0.005, 256, 1, "4,2,16"
        args.run = args.overlap = True
    args.cp = [int(c) for c in args.cp.split(",") if c]
    args.attn_shape = tuple(int(x) for x in args.attn_shape.split(","))
    if args.attn_kernel is None:
        args.attn_kernel = "flex" if args.device.startswith("cuda") else "runs"
    t0 = time.perf_counter()
    eps = episodes(args.scale, args.groups)
    lengths = [len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"]]
    longest = max(lengths)
    layouts = Pack(layout="tree", scope="group")(eps)
    budgets = sorted({-(-longest // 4), -(-longest // 2), longest})
    plan = [plan_row(layouts, size, b) for b in budgets for size in [1, *args.cp]]
    out = {"scale": args.scale, "groups": args.groups, "episodes": eps.num_rows,
           "calls": len(lengths), "longest_call": longest,
           "unique_tokens": int(sum(len(t) for t in layouts.column("tokens").to_pylist())),
           "exact_tokens": int(sum(lengths)), "plan": plan}
    out["plan_seconds"] = round(time.perf_counter() - t0, 2)
    if args.run:
        bin_budget = max(args.cp, default=1) * longest
        out["run"] = {"device": args.device, "dtype": args.dtype, "model": args.model,
                      "bin_budget": bin_budget, "rows": run_rows(args, eps, bin_budget)}
    if args.overlap:
        bin_parents = {"first_bin": _first_bin_parents(eps, max(args.cp) * longest),
                       "chain": np.arange(-1, args.chain - 1, dtype=np.int64)}
        out["overlap"] = overlap_rows(args, bin_parents)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        from treeflow.atomic import atomic_open

        with atomic_open(args.out) as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
