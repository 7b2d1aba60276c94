"""Tiny Mamba-2 hybrids saved by transformers itself, and both sides of a parity check.

The oracle is transformers' own NemotronHForCausalLM / BambaForCausalLM (torch
path), run call by call as plain causal sequences with full-vocabulary
log-softmax; treeflow's side goes through Pack, Fragment and the Forward
runner. Nothing of treeflow's scan is used on the oracle side.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from treeflow.schemas import validate_episodes
from treeflow.stages import Forward, Fragment, Pack
from treeflow.ops import build_forward

# why the CPU hybrid tests need transformers >= 5.25 (the dev extra's pin): older releases
# floor Nemotron-H's dt at time_step_min, normalise Bamba over the whole inner width and
# build GraniteMoeHybrid's layers otherwise; the GPU tests pin settings where 5.17 agrees
HF_MAMBA_SEMANTICS = "its Mamba-2 hybrids compute what mamba_ssm and treeflow do"
CHUNK = 4  # small scan chunks, so branch points fall inside chunks and on their boundaries


def _sharpen(model, seed: int) -> None:
    """Weights far from init, so that a wrong norm, gate, D, dt or A cannot hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(("A_log", ".D", "dt_bias", "conv1d.bias")):
                p.add_(0.5 * noise)
            elif "norm" in name:
                p.add_(0.3 * noise)
            else:
                p.copy_(0.15 * noise)


def hf_model(family: str, seed: int = 0, **extra):
    import transformers

    torch.manual_seed(seed)
    # `extra` overrides these (a test's own setting replaces the default, never doubles it)
    if family == "nemotron_h":
        cfg = transformers.NemotronHConfig(**{
            **dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, ssm_state_size=8, mamba_num_heads=4,
                   mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=CHUNK,
                   layers_block_type=["linear_attention", "mlp", "full_attention",
                                      "linear_attention", "mlp"]), **extra})
        model = transformers.NemotronHForCausalLM(cfg)
    else:
        cfg = transformers.BambaConfig(**{
            **dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                   attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
                   mamba_d_state=8, mamba_n_heads=4, mamba_n_groups=2, mamba_d_conv=4,
                   mamba_chunk_size=CHUNK, pad_token_id=None), **extra})
        model = transformers.BambaForCausalLM(cfg)
    _sharpen(model, seed)
    return model.eval()


def save_hf(family: str, path, seed: int = 0, **extra):
    model = hf_model(family, seed, **extra)
    model.save_pretrained(path)
    return model


def episodes(prompt: int, seed: int = 0, vocab: int = 61) -> pa.Table:
    """A GRPO group of 3 (prompt of `prompt` tokens, then different samples) and a multi-level
    agent episode: call 2 extends call 1, call 3 branches off call 2's prompt, call 4 is a
    duplicate completion of call 1 sampled differently at its last token."""
    rng = np.random.default_rng(seed)

    def toks(n):
        return rng.integers(1, vocab, n).tolist()

    head = toks(prompt)
    group = [{"episode_id": f"g{i}", "group_id": "g", "advantage": 1.0 - i,
              "calls": [_call(head + toks(5 + 2 * i), prompt)]} for i in range(3)]
    c1 = toks(6) + toks(5)
    c2 = c1 + toks(4) + toks(7)
    c3 = c2[:13] + toks(6)
    c4 = c1[:-1] + toks(1)
    agent = {"episode_id": "a", "group_id": None, "advantage": 0.5,
             "calls": [_call(c1, 6), _call(c2, 15), _call(c3, 13), _call(c4, 6)]}
    return validate_episodes(pa.Table.from_pylist(group + [agent]))


def _call(tokens, start):
    return {"token_ids": tokens, "sampled_start": start}


def token_weights(eps: pa.Table, seed: int = 1) -> dict:
    """A fixed random weight per occurrence (sample_index, call, offset)."""
    rng = np.random.default_rng(seed)
    out = {}
    for row in eps.to_pylist():
        for k, c in enumerate(row["calls"]):
            for off in range(len(c["token_ids"]) - c["sampled_start"]):
                out[(row["sample_index"], k, off)] = float(rng.uniform(0.5, 1.5))
    return out


def hf_values(model, eps: pa.Table, weights: dict):
    """Per-occurrence logprobs and every parameter's gradient of sum(w * logprob), call by call."""
    model.zero_grad()
    values = {}
    dev = next(model.parameters()).device
    for row in eps.to_pylist():
        for k, c in enumerate(row["calls"]):
            ids = torch.tensor([c["token_ids"]], device=dev)
            s = c["sampled_start"]
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)[s - 1:-1]
            lp = lp.gather(-1, ids[0, s:, None])[:, 0]
            w = torch.tensor([weights[(row["sample_index"], k, o)] for o in range(len(lp))],
                             device=dev)
            (w * lp).sum().backward()
            for o, v in enumerate(lp.tolist()):
                values[(row["sample_index"], k, o)] = v
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return values, grads


def treeflow_values(backend, eps: pa.Table, weights: dict, *, layout: str, max_tokens: int,
                    kernel: str = "dense", grad: bool = True):
    """The same through Pack, Fragment and the Forward runner; also the number of bins."""
    scope = "group" if layout == "tree" else None
    bins = Fragment(max_tokens=max_tokens)(Pack(layout=layout, scope=scope)(eps))
    runner = build_forward(Forward(kernel=kernel), model=backend)
    backend.module.zero_grad()
    values = {}
    with torch.set_grad_enabled(grad):
        for b in bins.to_pylist():
            if not b["edge_sources"]:
                continue
            lp, _ = runner.edge_logprobs(*(np.asarray(b[k], dtype=np.int64) for k in (
                "tokens", "parents", "positions", "edge_sources", "edge_targets")))
            keys = list(zip(b["occ_sample_index"], b["occ_call"], b["occ_offset"]))
            edge = torch.as_tensor(b["occ_edge"], dtype=torch.int64, device=lp.device)
            w = torch.tensor([weights[k] for k in keys], device=lp.device)
            if grad:
                (w * lp[edge]).sum().backward()
            for key, v in zip(keys, lp[edge].tolist()):
                values[key] = v
    grads = {n: p.grad.clone() for n, p in backend.module.named_parameters()
             if p.grad is not None}
    return values, grads, bins.num_rows
