"""The memory planner's view of a model: its layer kinds, widths and parameter counts.

train/memory_plan.py plans a rank's peak from these and from the per-token activation bytes
of train/memory_activations.py. Everything here is read from the config alone (no weights),
so `treeflow plan --memory` answers for a model that is not downloaded. The trade-off: a
family is modelled only once its layer kinds are named here (`layer_kinds` refuses the
others, naming the families it models), rather than guessed from a near relative.

Legend: H hidden, I intermediate, Hq = heads x head_dim, Hkv = kv heads x head_dim, V
vocabulary.
"""

from __future__ import annotations

from treeflow.models.config.gdn import GDN_ARCHITECTURES
from treeflow.train.memory_gdn import GDN_KINDS, gdn_parameters

__all__ = ["MAMBA2_KINDS", "layer_kinds", "model_dims", "parameter_counts", "rotary_dim"]

# the kinds of a Mamba-2 hybrid's blocks (Nemotron-H: one mixer a block; Bamba: mixer + MLP)
MAMBA2_KINDS = ("mamba", "mamba+mlp", "attention_only", "mlp", "moe_only")


def layer_kinds(c) -> list[str]:
    """Each layer's kind: attention (+ its MLP), moe (attention + experts), or a hybrid block's
    mixer (mamba, attention_only, mlp, moe_only); Bamba/Granite layers are mixer + MLP."""
    layer_types = getattr(c, "layer_types", None)
    if not layer_types:  # attention decoder
        moe = c.moe.moe_layers if c.moe is not None else ()
        return ["moe" if i in moe else "attention" for i in range(c.num_hidden_layers)]
    if c.architecture == "NemotronHForCausalLM":
        return [{"mamba": "mamba", "attention": "attention_only", "mlp": "mlp",
                 "moe": "moe_only"}[t] for t in layer_types]
    if c.architecture == "BambaForCausalLM":
        return ["mamba+mlp" if t == "mamba" else "attention" for t in layer_types]
    if c.architecture in GDN_ARCHITECTURES:  # Qwen3-Next / Qwen3.5: mixer + MLP or MoE block
        moe = c.moe.moe_layers if c.moe is not None else ()
        return [("gdn" if t == "gdn" else "gated_attention") + ("+moe" if i in moe else "+mlp")
                for i, t in enumerate(layer_types)]
    raise ValueError(f"the memory planner has no formula for {c.architecture} yet (it models "
                     "Llama/Qwen2/Qwen3, Qwen3-MoE/Qwen2-MoE/Mixtral, Nemotron-H, Bamba, "
                     "Qwen3-Next and Qwen3.5)")


def model_dims(c) -> dict:
    d = c.head_dim
    return dict(H=c.hidden_size, I=c.intermediate_size, Hq=c.num_attention_heads * d,
                Hkv=c.num_key_value_heads * d, heads=c.num_attention_heads, V=c.vocab_size)


def rotary_dim(c) -> int:
    if getattr(c, "layer_types", None):
        if c.architecture == "NemotronHForCausalLM":
            return 0
        return int(c.head_dim * c.partial_rotary_factor)
    return c.head_dim


def parameter_counts(c) -> dict:
    """{"total", "matmul" (the layers' matmul weights), "mixer_matmul" (those of the token
    mixers: attention, Gated DeltaNet, Mamba-2; the rest of "matmul" is the MLP / expert
    blocks'), "embedding", "float32_router" (router weights read in float32: never cast),
    "float32_gathered"} parameter counts."""
    g = model_dims(c)
    H, I, Hq, Hkv, V = g["H"], g["I"], g["Hq"], g["Hkv"], g["V"]
    embed = V * H
    head = 0 if c.tie_word_embeddings else V * H
    total, matmul, router = embed + head + H, 0, 0  # the head's cast is transient (loss chunks)
    mixer_matmul = 0
    float32_mixer = 0  # a Mamba-2 mixer's conv, A_log, D, dt_bias, gated norm (train/fsdp.py)
    hybrid = bool(getattr(c, "layer_types", None))
    attn_mm = H * (Hq + 2 * Hkv) + Hq * H
    attn_other = (Hq + 2 * Hkv if getattr(c, "attention_bias", False) else 0) + \
        (2 * c.head_dim if getattr(c, "qk_norm", False) else 0)
    gated = 3 if not hybrid or c.architecture != "NemotronHForCausalLM" else 2  # relu^2: 2
    for kind in layer_kinds(c):
        mm = other = mixer = 0
        if kind in ("attention", "moe", "attention_only"):
            mixer, other = attn_mm, other + attn_other
        if kind in ("attention", "mlp", "mamba+mlp") or kind.endswith("+mlp"):
            mm += gated * H * I
        if kind.split("+")[0] in GDN_KINDS:
            g_mm, g_other, g_wide = gdn_parameters(c, kind.split("+")[0])
            mixer, other, float32_mixer = g_mm, other + g_other, float32_mixer + g_wide
        if kind in ("moe", "moe_only") or kind.endswith("+moe"):
            m = c.moe
            inner = m.latent_size or H
            per = (2 if m.family == "nemotron_h" else 3) * inner * m.moe_intermediate_size
            mm += m.num_experts * per + m.num_experts * H
            if m.router_dtype == "float32" or m.family == "nemotron_h":
                router += m.num_experts * H  # read in float32: never cast
            s = m.shared_expert_intermediate_size
            mm += (2 if m.family == "nemotron_h" else 3) * H * s if s else 0
            mm += H if m.family == "qwen2_moe" else 0
            mm += 2 * H * m.latent_size if m.latent_size else 0
        if kind in ("mamba", "mamba+mlp"):
            h, inner, conv = c.mamba_num_heads, c.mamba_intermediate, c.conv_dim
            mixer = H * (inner + conv + h) + inner * H
            state = conv * c.conv_kernel + (conv if c.use_conv_bias else 0) + 3 * h + inner
            other += state
            float32_mixer += state
        norms = 1 if kind in ("mamba", "attention_only", "mlp", "moe_only") else 2
        total += mm + mixer + other + norms * H
        matmul += mm + mixer
        mixer_matmul += mixer
    return {"total": total, "matmul": matmul, "mixer_matmul": mixer_matmul, "embedding": embed,
            "float32_router": router, "float32_gathered": router + float32_mixer}
