"""`treeflow synth`, `inspect` and `plan`: episodes written, measured, and planned into bins.

`plan` runs each rank's map stages exactly as training builds them (pipeline/rank_plan.py), one
rank after another, so the bins it writes are the bins `--mode train --num-ranks N` runs.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack

from treeflow._display import console, count_rows, progress, table
from treeflow.cli.common import positive, show
from treeflow.cli.groups import group
from treeflow.cli.options import group_window_option, layout_options

__all__ = ["add_plan_parsers", "add_synth_parser", "cmd_inspect", "cmd_plan", "cmd_synth"]


def cmd_synth(args) -> int:
    from treeflow.tools.synth import routes_like, synth_episodes, write_episodes

    from treeflow.atomic import check_output

    positive(args, "episodes", "group_size", "min_turns", "max_turns", "vocab_size")
    from treeflow.lock import claim_output

    check_output(args.output, what="-o output")
    if not args.output.endswith((".arrow", ".parquet")):
        raise ValueError(f"-o {args.output}: unknown episode file type; name it .arrow (Arrow IPC) "
                         "or .parquet")
    claim_output(args.output, option="-o")
    t0 = time.perf_counter()
    routes = routes_like(args.routes_from) if args.routes_from else dict(
        routes=args.routes, route_layers=args.route_layers, num_experts=args.num_experts)
    eps = synth_episodes(episodes=args.episodes, group_size=args.group_size,
                         turns=(args.min_turns, args.max_turns), vocab_size=args.vocab_size,
                         branch_prob=args.branch_prob, seed=args.seed, **routes)
    write_episodes(eps, args.output)
    n_calls = sum(len(c) for c in eps.column("calls").to_pylist()) if eps.num_rows < 5000 else None
    if not args.quiet:
        console().print(f"wrote {eps.num_rows} episodes" + (f" ({n_calls} calls)" if n_calls else "")
                        + f" to {args.output} in {time.perf_counter() - t0:.2f}s")
    return 0


def cmd_inspect(args) -> int:
    from treeflow.pipeline.rank_plan import deal_cost
    from treeflow.pipeline.source import Files
    from treeflow.tools.inspect import inspect_windows

    positive(args, "max_tokens", "episodes_per_step", "num_ranks")
    cost = deal_cost(args.model)[0] if args.max_tokens else None
    with progress("inspect", count_rows(args.files), args.json or args.quiet) as advance:
        figures = inspect_windows(Files(paths=tuple(args.files),
                                        episodes_per_step=args.episodes_per_step,
                                        group_window=args.group_window),
                                  max_tokens=args.max_tokens, plot=args.plot,
                                  num_ranks=args.num_ranks, cost=cost,
                                  what=" ".join(args.files),
                                  advance=advance)
    totals, dist, plots = figures["totals"], figures["per_episode"], figures["plots"]
    if args.json:
        print(json.dumps(figures))
        return 0
    if args.quiet:
        return 0
    con = console()
    con.print(table("totals", list(totals.items())))
    import sys

    from rich import box
    from rich.table import Table

    t = Table(title="per episode", box=box.HEAVY_HEAD if sys.stdout.isatty() else box.ASCII)
    for h in ("field", "mean", "min", "p50", "p90", "max"):
        t.add_column(h, justify="right" if h != "field" else "left")
    for c, d in dist.items():
        t.add_row(c, *(f"{d[k]:,.1f}" for k in ("mean", "min", "p50", "p90", "max")))
    con.print(t)
    for path in plots:
        con.print(f"plot written to {path}")
    return 0


def cmd_plan(args) -> int:
    """Plan steps the way `replay --mode train --num-ranks R` does: every rank its own share."""
    positive(args, "max_tokens", "num_ranks", "episodes_per_step", "context_parallel")
    if args.memory:
        from treeflow.cli.memory import cmd_memory

        return cmd_memory(args)
    if not args.files:
        raise ValueError("plan: give the episode files to plan into bins (or --memory to plan "
                         "one rank's device memory from --model)")
    from treeflow._output import table_output
    from treeflow.pipeline.rank_plan import deal_cost, plan_windows
    from treeflow.pipeline.source import Files

    cost, cost_name = deal_cost(args.model)
    if args.rank is not None and not 0 <= args.rank < args.num_ranks:
        raise ValueError(f"--rank {args.rank}: give a rank in [0, {args.num_ranks}) (--num-ranks "
                         f"{args.num_ranks}), or leave it out to plan every rank")
    t0 = time.perf_counter()
    with ExitStack() as stack:
        out = stack.enter_context(table_output(args.output, args.files, what="bins")) \
            if args.output else None
        advance = stack.enter_context(progress("plan", count_rows(args.files),
                                                args.json or args.quiet))
        sums = plan_windows(Files(paths=tuple(args.files),
                                  episodes_per_step=args.episodes_per_step,
                                  group_window=args.group_window),
                            layout=args.layout, scope=args.scope, share_rules=args.share_rules,
                            max_tokens=args.max_tokens * args.context_parallel,
                            num_ranks=args.num_ranks, rank=args.rank, cost=cost,
                            write=None if out is None else out.write, advance=advance)
    sums["seconds"] = time.perf_counter() - t0
    sums["cost_model"] = cost_name
    if show(args, f"plan: layout={args.layout} max_tokens={args.max_tokens} "
            f"ranks={args.num_ranks}", sums) and args.output:
        console().print(f"bins written to {args.output}")
    return 0


def add_synth_parser(sub, common) -> None:
    p = sub.add_parser("synth", parents=[common],
                       help="write synthetic agentic episodes (.arrow or .parquet)")
    out = group(p, "output")
    s = group(p, "data")
    out.add_argument("-o", "--output", required=True)
    s.add_argument("--episodes", type=int, default=64)
    s.add_argument("--group-size", type=int, default=8)
    s.add_argument("--min-turns", type=int, default=3)
    s.add_argument("--max-turns", type=int, default=10)
    s.add_argument("--vocab-size", type=int, default=32000)
    s.add_argument("--branch-prob", type=float, default=0.1)
    s.add_argument("--routes", type=int, default=0,
                   help="expert ids per token and MoE layer (top_k); 0 = no routes")
    s.add_argument("--route-layers", type=int, default=1,
                   help="MoE layers per route (width = route layers x --routes)")
    s.add_argument("--num-experts", type=int, default=128, help="expert ids are in [0, this)")
    s.add_argument("--routes-from", default=None, metavar="DIR",
                   help="routes of the shape a local MoE checkpoint replays (its config.json: "
                        "MoE layers x top_k, num_experts); overrides the three options above")
    s.add_argument("--seed", type=int, default=0)
    out.add_argument("--quiet", action="store_true", help="print nothing but errors")
    p.set_defaults(fn=cmd_synth)


def add_plan_parsers(sub, common) -> None:
    """inspect and plan."""
    s = sub.add_parser("inspect", parents=[common],
                       help="totals and per-episode distributions of each layout")
    data = group(s, "data")
    data.add_argument("files", nargs="+")
    data.add_argument("--episodes-per-step", type=int, default=256,
                      help="episodes packed together (a training step's window)")
    group_window_option(s)
    group(s, "model").add_argument(
        "--model", default=None, help="deal the ranks by this model's cost, as `plan` and "
        "training do ('tiny' or a local HF checkpoint dir; default: a Llama-1B shape)")
    group(s, "layout").add_argument("--max-tokens", type=int, default=None,
                                    help="also plan the tree's bins of this budget, as `plan` "
                                         "and training do")
    group(s, "parallel").add_argument("--num-ranks", type=int, default=1,
                                      help="data-parallel ranks of the bin plan")
    out = group(s, "output")
    out.add_argument("--plot", default=None, metavar="DIR",
                     help="write PNGs: savings.png, call_growth.png (+ bins.png with --max-tokens)")
    out.add_argument("--json", action="store_true")
    out.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("plan", parents=[common], help="pack, fragment and shard episodes into "
                       "bins; --memory: one training rank's predicted peak device memory")
    data = group(s, "data")
    data.add_argument("files", nargs="*")
    data.add_argument("--episodes-per-step", type=int, default=256,
                      help="episodes per optimizer step, planned as --mode train plans them")
    group_window_option(s)
    group(s, "model").add_argument(
        "--model", default=None, help="deal the ranks by this model's cost ('tiny' or a local HF "
        "checkpoint dir), as training with it does (default: a Llama-1B shape)")
    layout_options(s)
    group(s, "layout").add_argument("--max-tokens", type=int, required=True)
    par = group(s, "parallel")
    par.add_argument("--num-ranks", type=int, default=1)
    par.add_argument("--context-parallel", type=int, default=1, metavar="C",
                     help="plan bins of C x --max-tokens (each run over C processes)")
    par.add_argument("--rank", type=int, default=None,
                     help="plan only this rank's share (default: every rank, one after another)")
    mem = group(s, "train")  # the knobs of the training run the memory plan is for
    mem.add_argument("--memory", action="store_true",
                     help="print one training rank's predicted peak device memory by component "
                          "(weights, weight casts, gradients, optimizer, activations at "
                          "--max-tokens, temporaries) for --model; with episode files, of their "
                          "largest bin; with --device-memory also the largest --max-tokens "
                          "that fits")
    mem.add_argument("--ssm-fork", choices=("exact", "chunk"), default=None,
                     help="Mamba-2 hybrids: where the run forks a branch's state (its scan's "
                          "chunk fill, with episode files); default chunk")
    mem.add_argument("--device-memory", default=None, metavar="SIZE",
                     help="the card's memory, e.g. 80GiB (H100 80GB: 79.2GiB usable)")
    mem.add_argument("--recompute", choices=("auto", "none", "selective", "full", "mlp",
                                             "attention"), default=None,
                     help="activation recomputation the run will use (default none; mlp and "
                          "attention: attention decoders and Gated DeltaNet hybrids); auto: what "
                          "a training run's --recompute auto picks for --device-memory")
    mem.add_argument("--shard-params", action="store_true",
                     help="FSDP2 shards weights, gradients and AdamW state over --num-ranks")
    mem.add_argument("--offload", action="store_true",
                     help="with --shard-params: the float32 shards, gradients and AdamW state "
                          "in host memory (host_bytes), not on the device")
    mem.add_argument("--precision", choices=("mixed", "pure"), default="mixed",
                     help="mixed: float32 weights and AdamW, --dtype computes; pure: all in "
                          "--dtype")
    mem.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                     help="the compute dtype")
    mem.add_argument("--grad-sum", choices=("float32", "float64"), default="float32",
                     help="float64: the step's gradient sums add 8 bytes per parameter")
    out = group(s, "output")
    out.add_argument("-o", "--output", default=None, help="write the bins (.arrow or .parquet)")
    out.add_argument("--json", action="store_true")
    out.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    s.set_defaults(fn=cmd_plan)
