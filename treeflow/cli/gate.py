"""`treeflow gate`: the design's validation gate as one command (treeflow/programs/gate.py).

    treeflow gate --model tiny -o gate.json                      # embedded queue, CPU
    treeflow gate --model DIR --device cuda --dtype bfloat16 --queue-backend transferqueue

Prints the gate's figures and writes them as JSON (`-o`); exits 0 when the
gate passes and 3 naming every cause when it fails (a lost or masked
episode, a generation KL above --max-gen-kl, a refit that did not happen,
route agreement over the decided rows, those whose top-k is no near-tie, below
--min-route-agreement under --routing replay). --routing goes to the trainer's
Forward, --context-parallel to its ParallelDims; --context-parallel C trains
in C processes (gloo on CPU, one GPU each on CUDA) that attach to the queue,
served on a temporary socket when --queue is not given. --fault is a test hook.
--episodes-out keeps the sampled episodes (both rounds) for a later look at them.
"""

from __future__ import annotations

import json
import os
import sys

from treeflow.cli import configs
from treeflow.cli.common import check_device
from treeflow.cli.groups import group
from treeflow.cli.options import add_sampling_options, queue_options
from treeflow.cli.queue import open_cli_queue

GATE_FAILED = 3


def cmd_gate(args) -> int:
    import torch

    from treeflow.atomic import atomic_open
    from treeflow.lock import claim_output
    from treeflow.programs import Gate, gate_address, gate_reduce, run_gate

    check_device(args.device)
    if args.rate is not None:
        raise ValueError(f"--rate {args.rate}: the gate's producer runs in lock-step with the "
                         "trainer (it samples once the weights of its round are out); leave it out")
    if args.output:  # checked and locked for the run (one writer), written atomically below
        claim_output(args.output, option="-o")
    if args.episodes_out:  # refused before any sampling when it cannot be written
        if not args.episodes_out.endswith((".arrow", ".parquet")):
            raise ValueError(f"--episodes-out {args.episodes_out}: give an episode file name "
                             "ending in '.arrow' (Arrow IPC) or '.parquet'")
        claim_output(args.episodes_out, option="--episodes-out")
    if args.threads:
        torch.set_num_threads(args.threads)
    from treeflow.cli.parallel import dims

    forward = configs.forward(args)  # the trainer's
    split = dims(args)  # --context-parallel C: C processes per bin
    gate = Gate(episodes=args.episodes, max_gen_kl=args.max_gen_kl, fault=args.fault,
                min_route_agreement=args.min_route_agreement,
                timeout=args.timeout,
                rollout=configs.rollout_config(args))
    reduce = gate_reduce(args.lr)
    gate.check_capacity(args.capacity)
    args.queue = gate_address(split.cp, args.queue_backend, args.queue)
    queue = open_cli_queue(args, forward.vocab_size_hint())
    # --debug: tracebacks of the failures the gate reports with its figures, in this process
    # and in its context-parallel ranks (they inherit the environment)
    debug = os.environ.get("TREEFLOW_DEBUG")
    if getattr(args, "debug", False):
        os.environ["TREEFLOW_DEBUG"] = "1"
    try:
        figures = run_gate(queue, forward=forward, reduce=reduce, gate=gate, layout=args.layout,
                           scope=args.scope, max_tokens=args.max_tokens, device=args.device,
                           queue_secret=args.queue_secret, dims=split,
                           episodes_out=args.episodes_out)
    finally:
        queue.shutdown()
        if debug is None:
            os.environ.pop("TREEFLOW_DEBUG", None)
        else:
            os.environ["TREEFLOW_DEBUG"] = debug
    figures.update(model=args.model, dtype=args.dtype, layout=args.layout,
                   queue_backend=args.queue_backend, routing=args.routing,
                   context_parallel=args.context_parallel, fault=args.fault)
    held = figures.get("sampler")
    if held and not args.quiet:   # what the sampler held next to the trainer (programs/gate.py)
        gib = f"{held['weights_bytes'] / 2**30:.3f} GiB of --dtype {args.dtype} weights"
        print(f"treeflow gate: the sampler held {gib} only while sampling: released while the "
              f"trainer stepped ({held['releases']} release(s), {held['loads']} load(s))"
              if held["held_while_waiting_bytes"] == 0 else
              f"treeflow gate: the sampler kept {gib} while the trainer stepped (it released "
              "nothing: no refit to wait for)", file=sys.stderr, flush=True)
    if args.output:
        with atomic_open(args.output, "w", what="gate figures") as f:
            json.dump(figures, f, indent=1)
    if args.json:
        print(json.dumps(figures), flush=True)
    elif not args.quiet:
        from treeflow._display import console, table

        console().print(table("gate", [(k, v) for k, v in figures.items() if k != "failures"]))
    for cause in figures["failures"]:
        print(f"gate failed: {cause}", file=sys.stderr, flush=True)
    return 0 if figures["passed"] else GATE_FAILED


def add_gate_parser(sub, common) -> None:
    from treeflow.compile_cache import add_option as add_compile_cache_option
    from treeflow.programs.gate import FAULTS

    s = sub.add_parser("gate", parents=[common],
                       help="the validation gate: sample, queue, one step, refit, sample again")
    m = group(s, "model")
    m.add_argument("--model", default="tiny", help="'tiny' or a local HF checkpoint dir")
    m.add_argument("--device", default="cpu")
    m.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    m.add_argument("--kernel", choices=("auto", "dense", "flex", "causal", "runs"), default="auto")
    m.add_argument("--tuning", default="plain",
                   help="speed levers of the reference backend (as replay's --tuning)")
    add_compile_cache_option(m)
    m.add_argument("--routing", choices=("replay", "recompute"), default=None,
                   help="MoE expert choice in the trainer (needs the MoE code; default: auto, "
                        "replay when the episodes carry routes)")
    lay = group(s, "layout")
    lay.add_argument("--layout", choices=("tree", "chain", "exact"), default="tree")
    lay.add_argument("--scope", choices=("episode", "group"), default=None)
    lay.add_argument("--max-tokens", type=int, default=16384)
    par = group(s, "parallel")
    par.add_argument("--context-parallel", type=int, default=1, metavar="C",
                     help="train in C processes, each a range of every bin's nodes")
    par.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    group(s, "train").add_argument("--lr", type=float, default=1e-5)
    queue_options(s)
    add_sampling_options(s, group_size_help="4: 4x4 groups; 16: one group")
    g = group(s, "gate")
    g.add_argument("--episodes", type=int, default=16, help="episodes per round (whole groups)")
    g.add_argument("--max-gen-kl", type=float, default=None,
                   help="largest generation KL accepted (default 1e-6 float32, 1e-3 bfloat16)")
    g.add_argument("--min-route-agreement", type=float, default=None,
                   help="under --routing replay, the least share of decided (token, MoE layer) "
                        "rows (top-k no near-tie) whose recomputed experts equal the captured "
                        "ones (default 1)")
    g.add_argument("--fault", choices=FAULTS, default=None,
                   help="test hook: inject this fault to see the gate fail naming it")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for a round or for weights before failing")
    out = group(s, "output")
    out.add_argument("-o", "--output", default=None, help="write the figures as JSON here")
    out.add_argument("--episodes-out", default=None, metavar="FILE",
                     help="keep every sampled episode (both rounds; .arrow or .parquet), "
                          "written when the gate ends, passed or failed")
    out.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    out.add_argument("--quiet", action="store_true", help="print nothing but the failures")
    s.set_defaults(fn=cmd_gate)


__all__ = ["GATE_FAILED", "add_gate_parser", "cmd_gate"]
