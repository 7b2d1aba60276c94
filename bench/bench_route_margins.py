"""Where the gate's route disagreements sit: the top-k margin of every disagreeing row.

The gate (`treeflow gate --routing replay`) reports `route_agreement` over every
replayed (token, MoE layer) row and checks `route_agreement_decided` over the
rows whose recomputed top-k is no near-tie (models/moe/ties.py: the k-th minus
(k+1)-th router logit above TIE_ULPS * eps * (|l_k| + |l_k+1|)). This script
shows whether every disagreement is such a near-tie, row by row: it samples
`--groups` groups with the gate's own sampler (programs/rollout.py
`sample_group`: the checkpoint in the compute dtype, routes captured), runs the
gate trainer's forward on them (`Trainer.logprobs`: float32 master weights
under bf16 autocast, tree layout, routing replay) with a hook on every MoE
block that asks the block for its own top-k, margin and near-tie band
(`MoeBlock.route_margins`, the numbers the gate counts), and prints as JSON
the rows, disagreements, near-ties, both agreements, and the distribution of
margin / band (and of the margin in logits) over the disagreeing rows: every
disagreement is a near-tie exactly when `disagree_decided` is 0 (max ratio <= 1).

    PYTHONUNBUFFERED=1 python bench/bench_route_margins.py --model DIR   # one GPU, bf16
    python bench/bench_route_margins.py --smoke --device cpu             # a small random MoE

bench/bench_gate_gpu.py runs it after the gate on the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# a small router with many near-ties in bf16 (hidden 256, 32 experts, top-4) for --smoke
SMOKE_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4,
             "moe_intermediate_size": 32, "norm_topk_prob": True}


def write_smoke_moe(path: str) -> None:
    from treeflow.models import ModelConfig, save_model
    from treeflow.models.checkpoint import seeded_decoder

    save_model(seeded_decoder(ModelConfig.from_hf_dict(SMOKE_MOE)), path)


def _quantiles(values) -> dict | None:
    import numpy as np

    if len(values) == 0:
        return None
    q = np.quantile(np.asarray(values, dtype=np.float64), [0.0, 0.5, 0.9, 0.99, 1.0])
    return dict(zip(("min", "q50", "q90", "q99", "max"), (float(v) for v in q)))


def route_margins(model: str, *, device: str = "cuda", dtype: str = "bfloat16",
                  rollout=None, groups: int = 2, layout: str = "tree",
                  max_tokens: int = 16384) -> dict:
    """Sample `groups` groups, replay their routes through the trainer's forward, and
    describe the margins of the rows whose recomputed top-k disagrees (see above)."""
    import numpy as np
    import pyarrow as pa
    import torch

    from treeflow.models.backend import load_backend
    from treeflow.models.moe.block import MoeBlock
    from treeflow.models.moe.ties import TIE_ULPS
    from treeflow.programs.rollout import Rollout, sample_group
    from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce
    from treeflow.train import Trainer

    rollout = rollout or Rollout(group_size=4)
    t0 = time.perf_counter()
    sampler = load_backend("reference", model, device=device,
                           dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    episodes = pa.concat_tables([sample_group(sampler, rollout, g, producer="margins")
                                 for g in range(groups)])
    del sampler
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    sample_s = time.perf_counter() - t0
    forward = Forward(model=model, dtype=dtype, routing="replay")
    trainer = Trainer(forward, Reduce(loss=Loss(kind="pg"), schedule=EpisodeSchedule(lr=0.0)),
                      device=device, max_tokens=max_tokens)
    rows: list[dict] = []

    def hook(block, args, kwargs, out):
        x_NH, route_NK = args[0], args[1] if len(args) > 1 else None
        if route_NK is None:
            return
        own_NK, margin_N, band_N = block.route_margins(x_NH)
        given_N = (route_NK >= 0).all(-1)
        same_N = (own_NK.sort(-1).values == route_NK.sort(-1).values).all(-1)
        rows.append({"layer": block.layer_index, "same": same_N[given_N].cpu().numpy(),
                     "margin": margin_N[given_N].float().cpu().numpy(),
                     "band": band_N[given_N].float().cpu().numpy()})

    blocks = [m for m in trainer.runner.backend.module.modules() if isinstance(m, MoeBlock)]
    handles = [b.register_forward_hook(hook, with_kwargs=True) for b in blocks]
    t1 = time.perf_counter()
    try:
        bins = Fragment(max_tokens=max_tokens)(Pack(layout=layout)(episodes))
        trainer.logprobs(bins)
    finally:
        for h in handles:
            h.remove()
    tally = trainer.runner.take_route_tally(full=True)
    same = np.concatenate([r["same"] for r in rows])
    margin = np.concatenate([r["margin"] for r in rows])
    band = np.concatenate([r["band"] for r in rows])
    ratio = np.divide(margin, band, out=np.full_like(margin, np.inf), where=band > 0)
    tie, off = ratio <= 1.0, ~same
    edges = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, np.inf]
    hist = np.histogram(ratio[off], bins=edges)[0] if off.any() else np.zeros(len(edges) - 1)
    per_layer = []
    for layer in sorted({r["layer"] for r in rows}):
        s = np.concatenate([r["same"] for r in rows if r["layer"] == layer])
        m = np.concatenate([r["margin"] / np.maximum(r["band"], 1e-30) for r in rows
                            if r["layer"] == layer])
        per_layer.append({"layer": layer, "rows": int(len(s)), "disagree": int((~s).sum()),
                          "near_ties": int((m <= 1.0).sum())})
    decided = ~tie
    return {
        "model": model, "device": device, "dtype": dtype, "groups": groups,
        "episodes": episodes.num_rows, "tie_ulps": TIE_ULPS,
        "rows": int(len(same)), "disagree": int(off.sum()), "near_ties": int(tie.sum()),
        "route_agreement": float(same.mean()) if len(same) else None,
        "route_agreement_decided": float(same[decided].mean()) if decided.any() else None,
        "trainer_tally": list(tally) if tally else None,   # the same counts, as the gate reads
        "disagree_near_tie": int((off & tie).sum()), "disagree_decided": int((off & decided).sum()),
        "every_disagreement_a_near_tie": bool(not (off & decided).any()),
        "disagree_margin_over_band": _quantiles(ratio[off]),
        "disagree_margin_logits": _quantiles(margin[off]),
        "all_rows_margin_over_band": _quantiles(ratio),
        "disagree_histogram_margin_over_band": {
            f"{lo:g}-{hi:g}": int(n) for lo, hi, n in zip(edges[:-1], edges[1:], hist)},
        "per_layer": per_layer,
        "sample_seconds": round(sample_s, 2), "score_seconds": round(time.perf_counter() - t1, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="MoE checkpoint dir (--smoke: a small random one)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--smoke", action="store_true", help="a small random MoE, tiny episodes")
    args = ap.parse_args()
    from treeflow.programs.rollout import Rollout

    rollout = Rollout(group_size=4, turns=(3, 4), prompt_tokens=(256, 512),
                      completion_tokens=(32, 64), tool_tokens=(32, 96))
    if args.smoke:
        rollout = Rollout(group_size=4, turns=(2, 3), prompt_tokens=(16, 32),
                          completion_tokens=(4, 8), tool_tokens=(2, 6))
        if args.model is None:
            args.model = os.path.join(tempfile.mkdtemp(prefix="treeflow-margins-"), "model")
            write_smoke_moe(args.model)
    if args.model is None:
        raise SystemExit("give --model DIR (an MoE checkpoint), or --smoke")
    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)
    res = route_margins(args.model, device=args.device, dtype=args.dtype, rollout=rollout,
                        groups=args.groups)
    print(json.dumps(res, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
