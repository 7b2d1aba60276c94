"""CPU, bf16: which --ssm-fork matches the exact-call layout more closely (the default's evidence).

A random Nemotron-H checkpoint (transformers' class, 10 blocks: 5 Mamba-2, 4 MLP, 1
attention; chunk 16 so that forks fall inside and on chunks; weights scaled x3 so the
recurrent state matters) and 16 short synthetic episodes in groups of 4. treeflow in
pure bfloat16 (tree with each fork mode, whole and fragmented; the exact layout), each
with float32 and bfloat16 inter-chunk states: mean / max |logprob - transformers
float32 per call| and the direct distance to the exact layout's bf16 logprobs (with the
count of bit-identical tokens). Next to transformers' own bf16 per call.

    python bench/bench_hybrid_forks_cpu.py       # ~5 min on a shared 2-core CPU
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from treeflow.models import Tuning, load_backend  # noqa: E402
from treeflow.tools import synth_episodes  # noqa: E402
from treeflow.stages import Forward, Fragment, Pack  # noqa: E402
from treeflow.ops import build_forward


def checkpoint(path):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.NemotronHConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, ssm_state_size=32, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=16,
        hybrid_override_pattern="M-M*M-M-M-")
    hf = transformers.NemotronHForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(("A_log", ".D", "dt_bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif "norm" not in n:
                p.mul_(3.0)
    hf.save_pretrained(path)
    return hf.eval()


def hf_values(hf, eps, dtype):
    m, out = hf.to(dtype), {}
    with torch.no_grad():
        for row in eps.to_pylist():
            for k, c in enumerate(row["calls"]):
                ids, s = torch.tensor([c["token_ids"]]), c["sampled_start"]
                lp = torch.log_softmax(m(ids).logits[0].float(), -1)[s - 1:-1]
                for o, v in enumerate(lp.gather(-1, ids[0, s:, None])[:, 0].tolist()):
                    out[(row["sample_index"], k, o)] = v
    return out


def treeflow_values(backend, eps, layout, max_tokens):
    bins = Fragment(max_tokens=max_tokens)(
        Pack(layout=layout, scope="group" if layout == "tree" else None)(eps))
    runner, out = build_forward(Forward(kernel="runs"), model=backend), {}
    with torch.no_grad():
        for b in bins.to_pylist():
            if not b["edge_sources"]:
                continue
            lp, _ = runner.edge_logprobs(*(np.asarray(b[k], dtype=np.int64) for k in (
                "tokens", "parents", "positions", "edge_sources", "edge_targets")))
            for key, e in zip(zip(b["occ_sample_index"], b["occ_call"], b["occ_offset"]),
                              b["occ_edge"]):
                out[key] = float(lp[e])
    return out


def dist(a, b):
    d = np.array([abs(a[k] - b[k]) for k in b])
    return {"mean": round(float(d.mean()), 5), "max": round(float(d.max()), 4),
            "identical": int((d == 0).sum()), "tokens": len(d)}


def main():
    import tempfile

    path = tempfile.mkdtemp(prefix="treeflow-forks-")
    hf = checkpoint(path)
    eps = synth_episodes(episodes=16, group_size=4, turns=(2, 4), system_tokens=40,
                         user_tokens=(5, 30), completion_tokens=(5, 40), tool_tokens=(5, 30),
                         vocab_size=256, seed=3)
    ref = hf_values(hf, eps, torch.float32)
    res = {"transformers_bf16_vs_float32": dist(hf_values(hf, eps, torch.bfloat16), ref)}
    runs = {"tree_exact_fork": ("tree", "exact", 100000),
            "tree_chunk_fork": ("tree", "chunk", 100000),
            "tree_exact_fork_fragments": ("tree", "exact", 400),
            "tree_chunk_fork_fragments": ("tree", "chunk", 400),
            "exact_layout": ("exact", "chunk", 100000)}
    for state in ("float32", "bfloat16"):
        vals = {}
        for name, (layout, fork, budget) in runs.items():
            b = load_backend("reference", path, dtype=torch.bfloat16,
                             tuning=Tuning(ssm_fork=fork, ssm_state_dtype=state))
            vals[name] = treeflow_values(b, eps, layout, budget)
        res[f"states_{state}"] = {
            name: {"vs_float32_transformers": dist(v, ref),
                   "vs_exact_layout_bf16": dist(v, vals["exact_layout"])}
            for name, v in vals.items()}
        print(json.dumps(res[f"states_{state}"]), flush=True)
    out = os.path.join(HERE, "results", "cpu_hybrid_forks.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["transformers_bf16_vs_float32"]))


if __name__ == "__main__":
    main()
