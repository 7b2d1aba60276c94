"""`treeflow plan --memory` and the memory check `replay --mode train` runs before a model loads.

Both read the model's config.json only (no weights) and call train/memory_plan.py's formulas
with the run's knobs, so the plan printed is the plan checked. Given episode files, `plan
--memory` plans their bins as training does and reports the largest bin's plan, with its own
token and edge counts and, for a Mamba-2 hybrid, its scan chunks' fill (a tree's short
segments pad chunks); without files every bin is taken full, every token an edge, every
chunk full. `--recompute auto` (the
default) is resolved here too (`auto_recompute`): where the card's size is known, the cheapest
mode whose plan fits it with the planner's margin (memory_plan.AUTO_MARGIN), said on stderr;
elsewhere none, silently. The check runs only where the
card's size is known: `--device-memory` given, or a CUDA device (its total memory); on CPU
without the flag there is nothing to check against and it is skipped.
"""

from __future__ import annotations

import sys

__all__ = ["auto_recompute", "check_fits", "cmd_memory", "memory_knobs"]


def memory_knobs(args, *, recompute: str) -> dict:
    """plan_memory's knobs from the parsed flags of `plan --memory` or `replay --mode train`."""
    device = str(getattr(args, "device", "cuda"))
    kernel = getattr(args, "kernel", "auto")
    if kernel == "auto":
        kernel = "flex" if device.startswith("cuda") else "dense"
    scan = getattr(args, "ssm_kernel", None) or "auto"
    if scan == "auto":  # models/ssm_tree.resolve_kernel's choice: the fused scan on CUDA
        scan = "triton" if device.startswith("cuda") else "torch"
    if (getattr(args, "context_parallel", 1) or 1) > 1:
        # a context-parallel rank's Mamba-2 heads run the torch scan (ssm/cp.py's SsmShard
        # builds its segment plan so), and the norms follow the scan's kernel
        scan = "torch"
    return dict(max_tokens=args.max_tokens, num_ranks=args.num_ranks, ssm_kernel=scan,
                context_parallel=getattr(args, "context_parallel", 1) or 1,
                shard_params=bool(getattr(args, "shard_params", False)), recompute=recompute,
                offload=bool(getattr(args, "offload", False)),
                precision=args.precision, dtype=args.dtype,
                grad_sum=getattr(args, "grad_sum", "float32"),
                chunk_size=getattr(args, "chunk_size", 1024), kernel=kernel)


def _config(model: str):
    """The model's shape from a checkpoint directory, a directory holding only config.json, or
    a Hugging Face config.json file itself (`plan --memory` needs no weights)."""
    import os

    from treeflow.stages import Forward
    from treeflow.train.checkpoint import model_dir

    if model != "tiny" and os.path.isfile(model):
        from treeflow._json import load as load_json
        from treeflow.models import ModelConfig

        d = load_json(model)
        if not isinstance(d, dict):
            raise ValueError(f"--model {model}: holds {type(d).__name__}, not a JSON object of "
                             "model settings (a Hugging Face config.json)")
        return ModelConfig.from_hf_dict(d)
    return Forward(model=model_dir(model) if model != "tiny" else model).model_config()


def cmd_memory(args) -> int:
    """Print one rank's predicted peak by component, and the largest --max-tokens that fits."""
    from treeflow.cli.common import show
    from treeflow.train.memory_plan import largest_max_tokens, parse_bytes, plan_memory

    if args.model is None:
        raise ValueError("plan --memory needs --model ('tiny', a local HF checkpoint dir or its "
                         "config.json alone)")
    config = _config(args.model)
    chosen = None
    if args.recompute == "auto":   # as a training run resolves it (auto_recompute)
        from treeflow.train.memory_plan import choose_recompute, recompute_modes

        args.recompute, chosen = "none", "none (no --device-memory to fit)"
        if args.device_memory:  # among the modes the model's family runs
            args.recompute, chosen = choose_recompute(
                _planned(config, args, recompute_modes(config)), parse_bytes(args.device_memory))
            chosen = f"{args.recompute} ({chosen})"
    knobs = memory_knobs(args, recompute=args.recompute or "none")
    if knobs["shard_params"]:
        from treeflow.models.support import check_sharded

        check_sharded(args.model, config, context_parallel=knobs["context_parallel"])
    if args.files:  # the episodes' own bins: the largest plan over them, not a full budget
        worst = max((plan_memory(config, **{**knobs, **b}) for b in _bins(args, config)),
                    key=lambda p: p.total, default=None)
        if worst is None:
            raise ValueError(f"plan --memory: {' '.join(args.files)} planned no bin")
        out = {**worst.as_dict(), "max_tokens": args.max_tokens, "from_bins": True}
    else:
        out = plan_memory(config, **knobs).as_dict()
    out["model"] = args.model
    if chosen is not None:
        out["recompute_auto"] = chosen
    if args.device_memory:
        card = parse_bytes(args.device_memory)
        out["device_memory_bytes"] = card
        out["fits"] = out["total_bytes"] <= card
        out["largest_max_tokens"] = largest_max_tokens(config, card, **knobs)
    show(args, f"plan --memory: {args.model} max_tokens={args.max_tokens} ranks={args.num_ranks} "
         f"recompute={knobs['recompute']} (GiB per rank)",
         {**out["gib"], "total": out["total_gib"],
          **{k: out[k] for k in ("fits", "largest_max_tokens") if k in out}} if not args.json
         else out)
    return 0


def _bins(args, config):
    """Per bin of the episodes, planned as training plans them: the plan_memory knobs of one
    rank's share of it (tokens / C under context parallelism, its edges, and for a Mamba-2
    hybrid the fill of its scan chunks: tokens / chunk slots of its segment plan)."""
    import math

    import numpy as np

    from treeflow.pipeline.rank_plan import deal_cost, plan_windows
    from treeflow.pipeline.source import Files

    tables = []
    cp = getattr(args, "context_parallel", 1) or 1
    plan_windows(Files(paths=tuple(args.files), episodes_per_step=args.episodes_per_step),
                 layout=args.layout, scope=args.scope, share_rules=args.share_rules,
                 max_tokens=args.max_tokens * cp, num_ranks=args.num_ranks,
                 cost=deal_cost(args.model)[0], write=tables.append)
    recurrent = getattr(config, "recurrent", False)
    for t in tables:
        parents = t.column("parents").to_pylist()
        edges = t.column("edge_sources").to_pylist()
        for p, e in zip(parents, edges):
            knobs = {"max_tokens": math.ceil(len(p) / cp), "edges": math.ceil(len(e) / cp)}
            if recurrent:
                from treeflow.models.ssm.tree import SegmentPlan

                seg = SegmentPlan(np.asarray(p), chunk_size=config.chunk_size,
                                  conv_kernel=config.conv_kernel, fork=args.ssm_fork or "chunk")
                knobs["scan_fill"] = len(p) / sum(int(lv.gather_KC.numel()) for lv in seg.levels)
            yield knobs


def _device_memory(args) -> int | None:
    from treeflow.train.memory_plan import parse_bytes

    if getattr(args, "device_memory", None):
        return parse_bytes(args.device_memory)
    device = str(args.device)
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def check_fits(args, *, recompute: str) -> dict | None:
    """Refuse a training run whose predicted per-rank peak exceeds the card (ValueError naming
    the flags to change); the plan's dict, or None where the card's size is unknown or the
    model has no formula (said on stderr)."""
    from treeflow.train.memory_plan import GIB, largest_max_tokens, plan_memory, recompute_modes

    card = _device_memory(args)
    if card is None or getattr(args, "backend", "reference") != "reference":
        return None
    try:
        config = _config(args.model)
        knobs = memory_knobs(args, recompute=recompute)
        plan = plan_memory(config, **knobs)
    except ValueError as e:
        print(f"treeflow: memory check skipped: {e}", file=sys.stderr, flush=True)
        return None
    if plan.total <= card:
        return plan.as_dict()
    best = largest_max_tokens(config, card, **knobs)
    gib = plan.as_dict()["gib"]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in gib.items())
    fixes = [f"--max-tokens {best} (the largest that fits)" if best else None]
    if knobs["recompute"] != "full" and len(recompute_modes(config)) > 1:
        other = "selective" if knobs["recompute"] == "none" else "full"
        fixes.append(f"--recompute {other}")
    if not knobs["shard_params"] and knobs["num_ranks"] > 1:
        fixes.append("--shard-params")
    fixes.append("more --num-ranks with --shard-params" if knobs["shard_params"] else None)
    fixes.append("--offload" if knobs["shard_params"] and not knobs["offload"] else None)
    fixes = [f for f in fixes if f]
    raise ValueError(f"--mode train: the predicted peak of one rank is {plan.total / GIB:.2f} GiB "
                     f"(--recompute {knobs['recompute']}) "
                     f"({parts} GiB) at --max-tokens {args.max_tokens}, more than the card's "
                     f"{card / GIB:.2f} GiB (--device-memory or the CUDA device): use "
                     f"{' or '.join(fixes)}; `treeflow plan --memory` prints the plan")


def auto_recompute(args, *, modes=None) -> str:
    """Resolve `--recompute auto` on `args` (set to the mode chosen) and return the mode.

    An explicit mode -- `--recompute X`, or a `recompute=` / preset setting in `--tuning` -- is
    never overridden (args.recompute becomes None: the tuning's stands). Where the card's size
    is unknown (CPU without --device-memory), for the megatron backend or a model without a
    formula: none. Else the cheapest of memory_plan.AUTO_ORDER the run can use (`modes`, default
    those models/support.py accepts for this model and split) whose plan x (1 + AUTO_MARGIN)
    fits the card (memory_plan.choose_recompute), said on stderr."""
    from treeflow.train.memory_plan import AUTO_ORDER, choose_recompute

    if getattr(args, "recompute", None) != "auto":
        return args.recompute
    args.recompute = None
    tuning = getattr(args, "tuning", "") or ""
    from treeflow.cli import configs

    given = configs.forward(args).tuning.recompute   # the preset's or --tuning's own
    if "recompute=" in tuning or given != "none":
        return given
    card = _device_memory(args)
    if card is None or getattr(args, "backend", "reference") != "reference":
        args.recompute = "none"
        return "none"
    try:
        config = _config(args.model)
        usable = modes if modes is not None else _usable_modes(args)
        planned = _planned(config, args, [m for m in AUTO_ORDER if m in usable])
    except ValueError as e:
        print(f"treeflow: --recompute auto: none ({e})", file=sys.stderr, flush=True)
        args.recompute = "none"
        return "none"
    mode, why = choose_recompute(planned, card)
    if planned[mode] <= card:   # over the card: check_fits refuses next, in its one line
        print(f"treeflow: --recompute auto: {mode} ({why}); give --recompute to choose",
              file=sys.stderr, flush=True)
    args.recompute = mode
    return mode


def _planned(config, args, modes) -> dict[str, int]:
    """Each recompute mode in `modes` -> the planned per-rank peak bytes of this run's knobs
    (what --recompute auto chooses among, in a training run and in plan --memory alike)."""
    from treeflow.train.memory_plan import plan_memory

    return {m: plan_memory(config, **memory_knobs(args, recompute=m)).total for m in modes}


def _usable_modes(args) -> list[str]:
    """The modes of memory_plan.AUTO_ORDER that models/support.py accepts for this run."""
    from treeflow.train.memory_plan import AUTO_ORDER

    usable = []
    for m in AUTO_ORDER:
        args.recompute = m
        try:
            from treeflow.cli import configs

            configs.forward(args)
        except ValueError:
            continue
        finally:
            args.recompute = None
        usable.append(m)
    return usable
