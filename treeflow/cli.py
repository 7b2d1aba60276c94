"""`treeflow` command line: synth, convert, inspect, plan, replay, stream, rollout.

Each command is a thin shell over the library: it parses options, streams
windows of episodes through stages, and prints a summary (rich tables, or one
JSON object with --json). Progress goes to stderr so that stdout stays clean;
--quiet prints nothing but errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack, nullcontext

import pyarrow as pa

from treeflow._clock import process_seconds
from treeflow._display import _console, _count_rows, _progress, _table
from treeflow.cli_convert import add_convert_parser
from treeflow.cli_parallel import (check_context_parallel_options, check_tensor_parallel_options,
                                   rank_of, start_ranks, torchrun_world)
from treeflow.cli_stream import add_stream_parsers
from treeflow.cli_train import add_train_options, cmd_train
from treeflow.cli_gate import add_gate_parser
from treeflow.compile_cache import add_option as add_compile_cache_option


# ---------------------------------------------------------------- synth
def cmd_synth(args) -> int:
    from treeflow.pipeline.synth import synth_episodes, write_episodes

    from treeflow.atomic import check_output

    _positive(args, "episodes", "group_size", "min_turns", "max_turns", "vocab_size")
    from treeflow.lock import claim_output

    check_output(args.output, what="-o output")
    if not args.output.endswith((".arrow", ".parquet")):
        raise ValueError(f"-o {args.output}: unknown episode file type; name it .arrow (Arrow IPC) "
                         "or .parquet")
    claim_output(args.output, option="-o")
    t0 = time.perf_counter()
    routes = dict(routes=args.routes, route_layers=args.route_layers, num_experts=args.num_experts)
    if args.routes_from:  # the shape a local MoE checkpoint replays: its MoE layers x top_k
        from treeflow.models import ModelConfig

        moe = ModelConfig.from_hf_dir(args.routes_from).moe
        if moe is None or not moe.moe_layers:
            raise ValueError(f"--routes-from {args.routes_from}: the model has no experts; give an "
                             "MoE checkpoint (Qwen3-MoE, Qwen2-MoE, Mixtral, Nemotron-H with MoE "
                             "blocks, GraniteMoeHybrid) or use --routes")
        routes = dict(routes=moe.top_k, route_layers=len(moe.moe_layers),
                      num_experts=moe.num_experts)
    table = synth_episodes(episodes=args.episodes, group_size=args.group_size,
                           turns=(args.min_turns, args.max_turns), vocab_size=args.vocab_size,
                           branch_prob=args.branch_prob, seed=args.seed, **routes)
    write_episodes(table, args.output)
    n_calls = sum(len(c) for c in table.column("calls").to_pylist()) if table.num_rows < 5000 else None
    if not args.quiet:
        _console().print(f"wrote {table.num_rows} episodes" + (f" ({n_calls} calls)" if n_calls else "")
                         + f" to {args.output} in {time.perf_counter() - t0:.2f}s")
    return 0


# ---------------------------------------------------------------- inspect
def cmd_inspect(args) -> int:
    import polars as pl

    from treeflow.pipeline.source import Files
    from treeflow.pipeline.stats import bin_stats, call_stats, merge_totals, window_stats

    _positive(args, "max_tokens", "window")
    frames, parts, call_frames, bin_frames = [], [], [], []
    with _progress("inspect", _count_rows(args.files), args.json or args.quiet) as advance:
        for step, window in enumerate(Files(paths=tuple(args.files), episodes_per_step=args.window)):
            frame, totals = window_stats(window, max_tokens=args.max_tokens)
            frames.append(frame)
            parts.append(totals)
            if args.plot:
                call_frames.append(call_stats(window))
                if args.max_tokens:
                    bin_frames.append(bin_stats(window, max_tokens=args.max_tokens, ranks=args.ranks,
                                                step=step))
            advance(window.num_rows, tokens=totals["exact_tokens"])
    totals = merge_totals(parts)
    frame = pl.concat(frames) if frames else pl.DataFrame()
    plots = []
    if args.plot:
        from treeflow.plots import write_inspect_plots

        if not frame.height:
            raise ValueError(f"{' '.join(args.files)}: no episodes to plot")

        plots = write_inspect_plots(args.plot, episodes=frame, calls=pl.concat(call_frames),
                                    totals=totals, bins=pl.concat(bin_frames) if bin_frames else None,
                                    max_tokens=args.max_tokens, ranks=args.ranks)
    if frame.height:
        frame = frame.with_columns(saving_tree_episode=pl.col("exact_tokens") / pl.col("tree_episode_tokens"))
    dist_cols = [c for c in ("calls", "sampled_tokens", "exact_tokens", "chain_tokens",
                             "tree_episode_tokens", "saving_tree_episode") if c in frame.columns]
    dist = {}
    for c in dist_cols:
        s = frame[c]
        dist[c] = {"mean": float(s.mean()), "min": float(s.min()), "p50": float(s.quantile(0.5)),
                   "p90": float(s.quantile(0.9)), "max": float(s.max())}
    if args.json:
        print(json.dumps({"totals": totals, "per_episode": dist, "plots": plots}))
        return 0
    if args.quiet:
        return 0
    con = _console()
    con.print(_table("totals", list(totals.items())))
    from rich.table import Table

    t = Table(title="per episode")
    for h in ("field", "mean", "min", "p50", "p90", "max"):
        t.add_column(h, justify="right" if h != "field" else "left")
    for c, d in dist.items():
        t.add_row(c, *(f"{d[k]:,.1f}" for k in ("mean", "min", "p50", "p90", "max")))
    con.print(t)
    for path in plots:
        con.print(f"plot written to {path}")
    return 0


# ---------------------------------------------------------------- plan
def cmd_plan(args) -> int:
    """Plan steps the way `replay --mode train --ranks R` does: every rank its own share."""
    import tracemalloc

    import numpy as np

    from treeflow._output import table_output
    from treeflow.cli_train import plan_stages
    from treeflow.pipeline.source import Files
    from treeflow.stages._exchange import summed_costs
    from treeflow.stages.shard import CostModel, bin_costs

    _positive(args, "max_tokens", "ranks", "batch_episodes", "context_parallel")
    if args.rank is not None and not 0 <= args.rank < args.ranks:
        raise ValueError(f"--rank {args.rank}: give a rank in [0, {args.ranks}) (--ranks "
                         f"{args.ranks}), or leave it out to plan every rank")
    plan_ranks = range(args.ranks) if args.rank is None else (args.rank,)
    t0 = time.perf_counter()
    sums = dict(episodes=0, steps=0, ranks=args.ranks, bins=0, exact_tokens=0, layout_tokens=0,
                executed_tokens=0, repeated_tokens=0, edges=0, occurrences=0)
    imbalances, seconds, peaks, empty = [], [], [], 0
    with ExitStack() as stack:
        out = stack.enter_context(table_output(args.output, args.files, what="bins")) \
            if args.output else None
        advance = stack.enter_context(_progress("plan", _count_rows(args.files),
                                                args.json or args.quiet))
        for step, window in enumerate(Files(paths=tuple(args.files), episodes_per_step=args.batch_episodes)):
            rank_cost = np.zeros(args.ranks)
            # what the trainer's all-reduce of tree costs returns (in one process: O(N), untimed)
            costs = summed_costs(window, layout=args.layout, scope=args.scope,
                                 cost=CostModel.llama_1b()) if args.ranks > 1 else None
            for rank in plan_ranks:  # what rank `rank` of the trainer computes, timed alone
                pack, *maps = plan_stages(args, args.ranks, rank, lambda mine, c=costs: c)
                tracemalloc.start()
                t1 = time.perf_counter()
                layouts = pack.map(window, step=step)
                bins = layouts
                for stage in maps:
                    bins = stage.map(bins, step=step)
                seconds.append(time.perf_counter() - t1)
                peaks.append(tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
                if out is not None:
                    out.write(bins)
                rank_cost[rank] = float(bin_costs(bins, CostModel.llama_1b()).sum())
                empty += int(bins.num_rows == 0)
                sums["bins"] += bins.num_rows
                sums["exact_tokens"] += int(np.sum(layouts.column("exact_tokens").to_numpy()))
                sums["layout_tokens"] += _total_len(layouts, "tokens")
                sums["executed_tokens"] += _total_len(bins, "tokens")
                sums["repeated_tokens"] += int(np.sum(bins.column("repeated_tokens").to_numpy()))
                sums["edges"] += _total_len(bins, "edge_sources")
                sums["occurrences"] += _total_len(bins, "occ_edge")
            if args.rank is None:
                mean = rank_cost.mean()
                imbalances.append(float(rank_cost.max() / mean - 1.0) if mean > 0 else 0.0)
            sums["episodes"] += window.num_rows
            sums["steps"] += 1
            advance(window.num_rows)
    sums["saving"] = sums["exact_tokens"] / max(sums["executed_tokens"], 1)
    sums["repeated_share"] = sums["repeated_tokens"] / max(sums["executed_tokens"], 1)
    if args.rank is None:  # a split tree's layout is counted by each rank that shares it
        sums["rank_imbalance_max"] = float(max(imbalances, default=0.0))
        sums["rank_imbalance_mean"] = float(np.mean(imbalances)) if imbalances else 0.0
        sums["ranks_without_bins"] = empty
    sums["rank_plan_seconds_max"] = round(max(seconds, default=0.0), 4)
    sums["rank_plan_seconds_mean"] = round(float(np.mean(seconds)) if seconds else 0.0, 4)
    sums["rank_plan_peak_mib_max"] = round(max(peaks, default=0) / 2**20, 1)
    sums["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(sums))
    elif not args.quiet:
        _console().print(_table(f"plan: layout={args.layout} max_tokens={args.max_tokens} "
                                f"ranks={args.ranks}", list(sums.items())))
        if args.output:
            _console().print(f"bins written to {args.output}")
    return 0


def _total_len(table: pa.Table, col: str) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(pc.list_value_length(table.column(col))).as_py() or 0)


# ---------------------------------------------------------------- replay
def cmd_replay(args) -> int:
    if args.mode == "train":
        return cmd_train(args)
    if args.output is None:
        raise ValueError("--mode logprobs needs -o OUT.arrow (or OUT.parquet) for the results")
    check_tensor_parallel_options(args, train=False)
    check_context_parallel_options(args, train=False)
    if args.tensor_parallel > 1 and torchrun_world() is None:
        start_ranks(_replay_rank, args.tensor_parallel, args)
        return 0
    if args.context_parallel > 1 and torchrun_world() is None:
        start_ranks(_replay_rank, args.context_parallel, args)
        return 0
    return _replay(args)


def _replay_rank(args) -> None:
    _replay(args)


def _replay(args) -> int:
    """Logprobs mode; under tensor parallelism one of its processes (the first one writes)."""
    import resource

    import torch

    from treeflow._output import table_output
    from treeflow.models.tuning import Tuning, ssm_flags
    from treeflow.pipeline import Files, Pipeline
    from treeflow.pipeline.stats import add_sums
    from treeflow.stages import CostModel, Forward, Fragment, Pack, Reassemble, Shard
    from treeflow.train.checkpoint import model_dir

    _positive(args, "max_tokens", "window", "chunk_size", "ranks", "prefetch")
    check_device(args.device)
    lead, device = True, args.device
    if args.tensor_parallel > 1:  # one of the processes that hold a share of the model
        from treeflow.train.distributed import rank_device

        lead = rank_of() == 0
        device = rank_device(args.device, int(os.environ.get("LOCAL_RANK", rank_of())))
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
    group = None
    if args.context_parallel > 1:  # one of the processes that run each bin together
        from treeflow.train import DataParallel

        group = DataParallel.from_env(args.device)
        lead, device = group.rank == 0, str(group.device)
    quiet = args.json or args.quiet or not lead
    sums = dict(episodes=0, calls=0, sampled_tokens=0, exact_tokens=0, executed_tokens=0, bins=0,
                compile_seconds=0.0)
    t0 = time.perf_counter()
    output = (table_output(args.output, args.files, what="logprobs") if lead
              else nullcontext(_Discard()))
    with output as out:
        forward = Forward(model=model_dir(args.model), backend=args.backend, dtype=args.dtype,
                          kernel=args.kernel, entropy=args.entropy, chunk_size=args.chunk_size,
                          tensor_parallel=args.tensor_parallel,
                          context_parallel=args.context_parallel,
                          tuning=Tuning.parse(args.tuning, **ssm_flags(args)),
                          routing=args.routing, allow_nonfinite=args.allow_nonfinite)
        # Shard balances the bins over the ranks (the Ray engine's forward actors) by the
        # model's own cost; a context-parallel group holds bins of C x --max-tokens
        pipe = Pipeline(Pack(layout=args.layout, scope=args.scope,
                             share_rules=args.share_rules),
                        Fragment(max_tokens=args.max_tokens * args.context_parallel),
                        Shard(num_ranks=args.ranks, cost=CostModel.from_config(
                            forward.model_config(), training=False)), forward,
                        Reassemble(entropy=args.entropy))
        source = Files(paths=tuple(args.files), episodes_per_step=args.window,
                       vocab_size=forward.vocab_size_hint(), route_width=forward.route_width_hint())
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        total_rows = _count_rows(args.files)
        setup = time.perf_counter() - t0  # imports of the model code, device initialisation
        with _progress("replay", total_rows, quiet) as advance:
            for rec in pipe.run(source, device=device, engine=args.engine, ranks=args.ranks,
                                prefetch=args.prefetch):
                out.write(rec.output)
                add_sums(sums, rec.stats)
                advance(rec.episodes.num_rows, tokens=rec.stats["exact_tokens"])
    wall = time.perf_counter() - t0
    # start-up (model code imports, device initialisation, model load) and compile/warm-up are
    # one-off costs reported on their own; steady state is the rest of the wall time: reading,
    # preparing, running and writing every window, pipeline fill and drain included
    startup = setup + sums.pop("load_seconds", 0.0)
    steady = max(wall - startup - sums["compile_seconds"], 1e-9)
    sums.update(wall_seconds=round(wall, 3), startup_seconds=round(startup, 3),
                compile_seconds=round(sums["compile_seconds"], 3), steady_seconds=round(steady, 3),
                exact_tokens_per_s=round(sums["exact_tokens"] / steady),
                executed_tokens_per_s=round(sums["executed_tokens"] / steady),
                saving=round(sums["exact_tokens"] / max(sums["executed_tokens"], 1), 3),
                peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                process_seconds=round(process_seconds(), 3))
    for k in ("prepare_seconds", "device_seconds"):
        if k in sums:
            sums[k] = round(sums[k], 3)
    if sums.get("route_rows"):  # MoE: replayed (token, layer) rows whose own top-k agreed
        sums["route_agreement"] = round(sums.pop("route_agree") / sums.pop("route_rows"), 6)
    if "device_seconds" in sums:  # device time inside bins (CUDA events) over steady wall time
        sums["device_busy"] = round(sums["device_seconds"] / steady, 3)
    if device.startswith("cuda"):
        sums["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if group is not None:
        group.close()
    if not lead:
        return 0
    from treeflow.cli_help import idle_ranks_warning

    if (idle := idle_ranks_warning(args.engine, args.ranks, sums["bins"])) is not None:
        print(idle, file=sys.stderr)
    if args.tensor_parallel > 1:
        sums["tensor_parallel"] = args.tensor_parallel
    if args.context_parallel > 1:
        sums["context_parallel"] = args.context_parallel
    if args.json:
        print(json.dumps(sums))
    elif not args.quiet:
        _console().print(_table(f"replay: {args.model} layout={args.layout} "
                                f"max_tokens={args.max_tokens} {args.device}/{args.dtype}",
                                list(sums.items())))
        _console().print(f"logprobs written to {args.output}")
    return 0


class _Discard:
    """The output of a tensor-parallel process other than the first: every one computes the
    same results, one writes them."""

    def write(self, table) -> None:
        pass


def _positive(args, *names) -> None:
    """Refuse a count option below 1, naming the option (not the stage it would reach)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: give an integer >= 1")


def check_device(device: str) -> None:
    """Refuse a --device torch does not know, or CUDA where there is none, before any work."""
    from treeflow.stages.forward import resolve_device

    resolve_device(device, what="--device")


# ---------------------------------------------------------------- main
def model_options(s) -> None:
    """Options shared by replay and stream, so the two run the same episodes the same way."""
    s.add_argument("--model", default="tiny", help="'tiny' (built-in) or a local HF checkpoint dir")
    s.add_argument("--backend", choices=("reference", "megatron"), default="reference",
                   help="model backend: treeflow's PyTorch decoder or megatron-core's GPTModel "
                        "(pip install 'treeflow[megatron]')")
    s.add_argument("--layout", choices=("tree", "chain", "exact"), default="tree")
    s.add_argument("--scope", choices=("episode", "group"), default=None)
    s.add_argument("--share-rules", choices=("default", "nrl"), default="default",
                   help="prefix sharing: default (every token whose recomputation is identical) "
                        "or nrl (NeMo RL's exact-call rules: replica, weight-version and "
                        "KV-page cuts from the calls' execution metadata)")
    s.add_argument("--max-tokens", type=int, default=16384)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    s.add_argument("--kernel", choices=("auto", "dense", "flex", "causal", "runs"),
                   default="auto")
    s.add_argument("--chunk-size", type=int, default=1024, help="edges per vocabulary chunk")
    s.add_argument("--tuning", default="",
                   help="speed levers of the reference backend: a preset (fast: compiled "
                        "layers, fused edge loss, tuned flex tiles; lean: fast + MLP "
                        "recomputation) and/or name=value,... e.g. fast,recompute=attention or "
                        "compile_layers=1,flex.BLOCK_N=64 (treeflow.models.Tuning; default: none)")
    add_compile_cache_option(s)
    s.add_argument("--routing", choices=("auto", "replay", "recompute"), default="auto",
                   help="MoE experts: replay the episodes' routed_experts on every tree node "
                        "(combine weights from the current router), or let the router recompute "
                        "them; auto = replay when the episodes carry routes and the model has "
                        "experts")
    s.add_argument("--ssm-fork", choices=("exact", "chunk"), default=None,
                   help="Mamba-2 hybrids: fork a branch's recurrent state at the branch token "
                        "(exact) or at the last scan-chunk boundary, replaying the tail (chunk); "
                        "default: chunk")
    s.add_argument("--ssm-state-dtype", choices=("float32", "bfloat16"), default=None,
                   help="Mamba-2 hybrids: dtype of the materialised inter-chunk states in "
                        "forward and backward (default float32), whatever --dtype is")
    s.add_argument("--entropy", action="store_true", help="also write per-token entropies")
    s.add_argument("--allow-nonfinite", action="store_true",
                   help="write (train on) NaN/inf logprobs and losses with a warning instead of "
                        "stopping; a non-finite gradient never steps")
    s.add_argument("--window", type=int, default=64, help="episodes packed together")
    s.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: one process; ray: a Ray Data graph (RAY_ADDRESS or a local cluster)")
    s.add_argument("--prefetch", type=int, default=2, help="windows prepared ahead (engine local)")
    s.add_argument("--mode", choices=("logprobs", "train"), default="logprobs")
    s.add_argument("-o", "--output", default=None,
                   help="result file, .arrow (Arrow IPC) or .parquet (logprobs mode)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true", help="no progress bar, no summary")


def build_parser() -> argparse.ArgumentParser:
    from treeflow.cli_logging import add_verbose_option

    p = argparse.ArgumentParser(prog="treeflow", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks (or TREEFLOW_DEBUG=1)")
    add_verbose_option(p)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks (or TREEFLOW_DEBUG=1)")
    add_verbose_option(common)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("synth", parents=[common], help="write synthetic agentic episodes (.arrow or .parquet)")
    s.add_argument("-o", "--output", required=True)
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
    s.add_argument("--quiet", action="store_true", help="print nothing but errors")
    s.set_defaults(fn=cmd_synth)

    add_convert_parser(sub)

    s = sub.add_parser("replay", parents=[common], help="compute per-token logprobs of stored episodes")
    s.add_argument("files", nargs="+")
    model_options(s)
    s.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                   help="split the model over T processes (--backend megatron; one GPU each "
                        "with --device cuda); in training, T x --ranks processes")
    s.add_argument("--context-parallel", type=int, default=1, metavar="C",
                   help="run each bin over C processes (--backend reference; one GPU each with "
                        "--device cuda), each fetching only its nodes' ancestors' K/V; bins "
                        "hold up to C x --max-tokens; in training, C x --ranks processes")
    add_train_options(s)
    s.set_defaults(fn=cmd_replay)

    add_stream_parsers(sub, common, model_options)
    add_gate_parser(sub, common)

    s = sub.add_parser("inspect", parents=[common], help="totals and per-episode distributions of each layout")
    s.add_argument("files", nargs="+")
    s.add_argument("--max-tokens", type=int, default=None, help="also plan bins of this budget")
    s.add_argument("--window", type=int, default=256, help="episodes packed together")
    s.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNGs: savings.png, call_growth.png (+ bins.png with --max-tokens)")
    s.add_argument("--ranks", type=int, default=1, help="data-parallel ranks of the bin plan (--plot)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("plan", parents=[common], help="pack, fragment and shard episodes into bins")
    s.add_argument("files", nargs="+")
    s.add_argument("--layout", choices=("tree", "chain", "exact"), default="tree")
    s.add_argument("--scope", choices=("episode", "group"), default=None)
    s.add_argument("--share-rules", choices=("default", "nrl"), default="default",
                   help="prefix sharing: default (every token whose recomputation is identical) "
                        "or nrl (NeMo RL's exact-call rules: replica, weight-version and "
                        "KV-page cuts from the calls' execution metadata)")
    s.add_argument("--max-tokens", type=int, required=True)
    s.add_argument("--ranks", type=int, default=1)
    s.add_argument("--context-parallel", type=int, default=1, metavar="C",
                   help="plan bins of C x --max-tokens (each run over C processes)")
    s.add_argument("--batch-episodes", type=int, default=256, help="episodes per step")
    s.add_argument("--rank", type=int, default=None,
                   help="plan only this rank's share (default: every rank, one after another)")
    s.add_argument("-o", "--output", default=None, help="write the bins (.arrow or .parquet)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    s.set_defaults(fn=cmd_plan)

    from treeflow.cli_config import add_config_flags
    from treeflow.cli_help import finish_parser

    add_config_flags(p)
    finish_parser(p)
    return p


def _compile_cache(args) -> int:
    from treeflow.compile_cache import configure

    configure(args.compile_cache)
    return 0


def main(argv: list[str] | None = None) -> int:
    from treeflow._errors import debug_wanted, run

    from treeflow.cli_config import apply_config, print_config
    from treeflow.cli_logging import quiet_libraries

    parser = build_parser()
    args = run(lambda a: apply_config(parser, a), argv, debug=debug_wanted(
        "--debug" in (argv if argv is not None else sys.argv[1:])))
    if isinstance(args, int):  # the config file was refused (a one-line error)
        return args
    if getattr(args, "print_config", False):
        return print_config(args)
    quiet_libraries(getattr(args, "verbose", False) or debug_wanted(getattr(args, "debug", False)))
    if hasattr(args, "compile_cache"):  # before torch is imported: spawned ranks inherit it
        code = run(_compile_cache, args, debug=debug_wanted(getattr(args, "debug", False)))
        if code:
            return code
    return run(args.fn, args, debug=debug_wanted(getattr(args, "debug", False)))


if __name__ == "__main__":
    sys.exit(main())
