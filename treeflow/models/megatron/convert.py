"""Hugging Face Llama/Qwen2 state dicts <-> megatron-core GPTModel state dicts, and TP shards.

Pure tensor rearrangements, so the same functions convert weights on load,
on export, and gradients in tests. MCore's layouts:

- `linear_qkv` fuses Q, K and V *per query group*: for each of the K
  key/value groups, that group's Q/K heads' query rows, then its key rows,
  then its value rows (`[g0: q q k v][g1: q q k v]...`). A tensor-parallel
  rank owns whole groups, i.e. a contiguous block of rows. Qwen2's Q/K/V
  biases are fused the same way.
- `linear_fc1` fuses SwiGLU's gate and up projections as `[gate; up]` on
  every rank, so rank r holds `[gate_r; up_r]` (not a contiguous block of
  the unsharded tensor): sharding splits gate and up separately.
- column-parallel weights (QKV, fc1, embedding, output layer) split rows;
  row-parallel weights (attention output `linear_proj`, `linear_fc2`) split
  columns; norms, routers and the shared expert's gate are replicated.
- an MoE layer (megatron/moe.py) holds `mlp.router.weight`, one MLP per expert
  (`mlp.experts.local_experts.E.linear_fc1/fc2`, fc1 = `[gate; up]` like the
  dense MLP) and Qwen2-MoE's `mlp.shared_experts.*` (GLM-4.5's too, without the gate, and
  its `gate.e_score_correction_bias` as the router's `expert_bias` buffer, replicated);
  Qwen3-MoE's and GLM-4.5's q/k norms are `self_attention.q_layernorm` / `k_layernorm`.

A tied model has no `output_layer.weight`: the output layer reads the word
embedding. Tensors are named as in `GPTModel.state_dict()` built from
`tree_layer_spec` (MCore's local spec); `_extra_state` entries are not weights.

Legend: Q query heads, K key/value groups, D head dim, H hidden, I MLP width.
"""

from __future__ import annotations

import torch

from treeflow.models.config.model import ModelConfig

__all__ = ["hf_to_mcore", "mcore_to_hf", "shard", "tp_partition", "tp_view", "unshard",
           "unshard_tensor"]

_LAYER_RENAMES = {  # HF name after "model.layers.{i}." -> MCore name after "decoder.layers.{i}."
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")  # split along columns (dim 1)
_REPLICATED = ("layernorm.weight", "router.weight", "router.expert_bias",
               "shared_experts.gate_weight")
_QK_NORMS = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
             "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}


def _renames(c: ModelConfig, layer: int | None = None) -> list[tuple[str, str]]:
    """(HF name, MCore name) of the tensors that only change name: the model-level ones
    (no lm_head when tied), or those of layer `layer`; the same table both ways."""
    if layer is None:
        return [(hf_name, mc_name) for hf_name, mc_name in _GLOBAL_RENAMES.items()
                if not (hf_name == "lm_head.weight" and c.tie_word_embeddings)]
    a, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    renames = dict(_LAYER_RENAMES, **(_QK_NORMS if c.qk_norm else {}))
    if _is_moe(c, layer):  # its MLP is the experts (megatron/moe.py)
        del renames["mlp.down_proj.weight"]
    return [(a + hf_name, m + mc_name) for hf_name, mc_name in renames.items()]


def _is_moe(c: ModelConfig, layer: int) -> bool:
    return c.moe is not None and layer in c.moe.moe_layers


def hf_to_mcore(hf: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names and layouts -> an unsharded (TP=1) MCore state dict."""
    out = {mc_name: _take(hf, hf_name) for hf_name, mc_name in _renames(c)}
    for i in range(c.num_hidden_layers):
        a, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({mc_name: _take(hf, hf_name) for hf_name, mc_name in _renames(c, i)})
        for kind in ("weight", "bias") if c.attention_bias else ("weight",):
            out[f"{m}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                *(_take(hf, f"{a}self_attn.{x}_proj.{kind}") for x in "qkv"), c)
        if _is_moe(c, i):
            from treeflow.models.megatron.moe import moe_hf_to_mcore

            out.update(moe_hf_to_mcore(hf, c, i, _take))
            continue
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [_take(hf, a + "mlp.gate_proj.weight"), _take(hf, a + "mlp.up_proj.weight")])
    return out


def mcore_to_hf(mc: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """An unsharded MCore state dict -> HF names and layouts (the inverse of hf_to_mcore)."""
    out = {hf_name: _take(mc, mc_name) for hf_name, mc_name in _renames(c)}
    for i in range(c.num_hidden_layers):
        a, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({hf_name: _take(mc, mc_name) for hf_name, mc_name in _renames(c, i)})
        for kind in ("weight", "bias") if c.attention_bias else ("weight",):
            q, k, v = _split_qkv(_take(mc, f"{m}self_attention.linear_qkv.{kind}"), c)
            out.update({f"{a}self_attn.q_proj.{kind}": q, f"{a}self_attn.k_proj.{kind}": k,
                        f"{a}self_attn.v_proj.{kind}": v})
        if _is_moe(c, i):
            from treeflow.models.megatron.moe import moe_mcore_to_hf

            out.update(moe_mcore_to_hf(mc, c, i, _take))
            continue
        gate, up = _take(mc, m + "mlp.linear_fc1.weight").chunk(2)
        out[a + "mlp.gate_proj.weight"], out[a + "mlp.up_proj.weight"] = gate, up
    return out


def tp_partition(name: str) -> tuple[int | None, int]:
    """How tensor parallelism splits MCore tensor `name`: (dim, pieces).

    dim is None for a replicated tensor. pieces is 2 for `linear_fc1` (`[gate; up]`: each
    half is split on its own) and 1 otherwise. Viewed as `pieces` blocks stacked on a new
    leading dim (`tp_view`), every rank's part is one contiguous block along dim + (pieces > 1).
    """
    if name.endswith(_REPLICATED):
        return None, 1
    if name.endswith(_ROW_PARALLEL):
        return 1, 1
    if name.endswith("linear_fc1.weight"):
        return 0, 2
    return 0, 1  # column-parallel: QKV (whole groups), embedding and output layer (vocab rows)


def tp_view(t: torch.Tensor, name: str) -> tuple[torch.Tensor, int | None]:
    """`t` (unsharded or one rank's part) viewed so that a rank's part is one block: (view, dim)."""
    dim, pieces = tp_partition(name)
    if pieces == 1:
        return t, dim
    return t.reshape(pieces, t.shape[0] // pieces, *t.shape[1:]), dim + 1


def _flat(view: torch.Tensor, name: str) -> torch.Tensor:
    """The inverse of tp_view: the stacked pieces back into one leading dim."""
    return view.reshape(-1, *view.shape[2:]) if tp_partition(name)[1] > 1 else view


def shard(full: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of an unsharded MCore state dict under tensor parallelism `size`."""
    out = {}
    for name, t in full.items():
        view, dim = tp_view(t, name)
        if dim is None:
            out[name] = t
        else:
            out[name] = _flat(_chunk(view, size, dim, name)[rank], name)
    return out


def unshard(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The unsharded MCore state dict from every rank's part, in rank order (inverse of shard)."""
    return {name: unshard_tensor(name, [p[name] for p in parts]) for name in parts[0]}


def unshard_tensor(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The unsharded MCore tensor `name` from every rank's part, in rank order.

    A replicated tensor (a norm) is the first part itself.
    """
    views = [tp_view(p, name) for p in pieces]
    dim = views[0][1]
    if dim is None:
        return pieces[0]
    return _flat(torch.cat([v for v, _ in views], dim=dim), name)


def _take(state, name):
    if name not in state:
        raise ValueError(f"state dict lacks tensor {name!r}")
    return state[name]


def _chunk(t, size, dim, name):
    if t.shape[dim] % size:
        raise ValueError(f"{name} {tuple(t.shape)}: dim {dim} is not divisible by tensor "
                         f"parallelism {size}")
    return t.chunk(size, dim=dim)


def _fuse_qkv(q, k, v, c: ModelConfig):
    groups, per_group, d = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest),
                       v.reshape(groups, d, *rest)], dim=1)
    return fused.reshape(groups * (per_group + 2) * d, *rest)


def _split_qkv(fused, c: ModelConfig):
    groups, per_group, d = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, (per_group + 2) * d, *rest).split(
        [per_group * d, d, d], dim=1)
    return (q.reshape(groups * per_group * d, *rest), k.reshape(groups * d, *rest),
            v.reshape(groups * d, *rest))
