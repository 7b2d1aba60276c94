"""Which model families run where: the one declaration the code refuses from and README shows.

Each `Family` names the Hugging Face classes it reads and what it supports beyond the reference
backend's tree / chain / exact layouts (which every family has): MoE routing replay, context
parallelism, the reference backend's compile / recompute levers (`Tuning`; a family may
recompute without compiled layers: `no_compiled_layers` says why, the table "recompute only"),
and the megatron backend. The checks that refuse a combination (`require`) read these declarations, and
README's compatibility table is generated from them (`markdown_table`;
tests/models/test_families.py fails when README's copy is stale), so the table cannot claim
what the code refuses. Families the field trains but treeflow does not read yet are listed by
name (`NOT_YET`), so that refusing one names the family and what is supported instead of a
bare class name. The trade-off: a capability is declared per family, not per checkpoint, so a
checkpoint-level limit (MTP heads, a router aux loss, expert count) is still checked where the
checkpoint is read; the table says "per checkpoint" facts in its notes.

Plain Python (no torch): the CLI and configs check against it before anything loads.
"""

from __future__ import annotations

import dataclasses

__all__ = ["FAMILIES", "NOT_YET", "Family", "family_of", "lacks", "lacks_compiled_layers",
           "markdown_table", "require", "unsupported", "write_readme"]

LAYOUTS = ("tree", "chain", "exact")
FEATURES = {  # feature -> (table header, what a refusal calls it)
    "moe_replay": ("MoE routing replay", "MoE routing replay (--routing replay)"),
    "context_parallel": ("context parallel", "context parallelism (--context-parallel)"),
    "recompute": ("compile / recompute", "Tuning(compile_layers / recompute) (--tuning)"),
    "megatron": ("megatron backend", "the megatron backend (--backend megatron)"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family: its HF classes and what it supports (see the module docstring)."""

    name: str
    architectures: tuple[str, ...]
    experts: bool = False  # some checkpoints of the family have MoE layers
    moe_replay: bool = False
    context_parallel: bool = True
    recompute: bool = True
    megatron: bool = True
    # why the family's layers are not cut into compiled parts (compile/layer_ops.py), so that
    # Tuning(compile_layers) is refused; "" where they are. Recompute runs without them.
    no_compiled_layers: str = ""
    note: str = ""
    # {feature: why the family lacks it}, said in the refusal where the reason is not just "not
    # built yet" (what the underlying library lacks)
    why_not: dict = dataclasses.field(default_factory=dict, compare=False)


_MLA_ON_MCORE = (
    "megatron-core 0.16's multi-latent attention builds its own rotary embedding (RotaryEmbedding / "
    "YarnRotaryEmbedding on torch.cuda.current_device(), so it cannot even be built with a CPU "
    "torch) and applies it to positions 0..S-1 of the token stream, refusing the "
    "rotary_pos_emb a caller passes, so a tree's depth positions cannot reach it")
_MAMBA2 = "its Mamba-2 blocks are not cut into compiled parts"
_GDN = "its Gated DeltaNet layers are not cut into compiled parts"

FAMILIES = (
    Family(name="Llama", architectures=("LlamaForCausalLM",)),
    Family(name="Qwen2", architectures=("Qwen2ForCausalLM",), note="q/k/v biases"),
    Family(name="Qwen3", architectures=("Qwen3ForCausalLM",),
           note="q/k RMSNorm per head (MCore qk_layernorm)"),
    Family(name="Qwen3-MoE", architectures=("Qwen3MoeForCausalLM",), experts=True,
           moe_replay=True, note="megatron: TP/EP > 1 on CUDA only"),
    Family(name="Qwen2-MoE", architectures=("Qwen2MoeForCausalLM",), experts=True,
           moe_replay=True, note="shared expert; megatron: TP/EP > 1 on CUDA only"),
    Family(name="Mixtral", architectures=("MixtralForCausalLM",), experts=True,
           moe_replay=True, note="megatron: TP/EP > 1 on CUDA only"),
    Family(name="Gemma 3", architectures=("Gemma3ForCausalLM",), megatron=False,
           no_compiled_layers="its layers norm the attention and MLP outputs too ((1 + w) "
                              "post-norms), which the compiled parts (norm + q/k/v, o_proj + "
                              "residual, norm + MLP + residual) do not cut",
           note="text only; sliding-window layers (depth distance on trees), (1+w) norms; "
                "logit softcapping refused"),
    Family(name="gpt-oss", architectures=("GptOssForCausalLM",), experts=True,
           moe_replay=True, megatron=False,
           note="attention sinks, sliding-window layers, YaRN; dequantized (bf16/fp32) "
                "weights, MXFP4 refused"),
    Family(name="GLM-4.5", architectures=("Glm4MoeForCausalLM",), experts=True,
           moe_replay=True,
           note="sigmoid group-limited router with bias correction, shared experts, dense "
                "first layers; partial rotary, q/k norm; MTP layers frozen; megatron: MTP "
                "checkpoints refused, TP/EP > 1 on CUDA only"),
    Family(name="DeepSeek-V3", architectures=("DeepseekV3ForCausalLM",), experts=True,
           moe_replay=True, megatron=False,
           note="MLA (latent K/V expanded per head), YaRN, GLM-4.5's MoE; FP8 weights "
                "refused; MTP layers frozen; megatron: MCore's MLA computes its own RoPE",
           why_not={"megatron": _MLA_ON_MCORE}),
    Family(name="Nemotron-H", architectures=("NemotronHForCausalLM",), experts=True,
           moe_replay=True, megatron=False, no_compiled_layers=_MAMBA2,
           note="Mamba-2 tree state forks; MoE and MTP checkpoints (MTP frozen); "
                "recompute selective/full"),
    Family(name="Bamba", architectures=("BambaForCausalLM",), megatron=False,
           no_compiled_layers=_MAMBA2,
           note="Mamba-2 tree state forks; recompute selective/full"),
    Family(name="GraniteMoeHybrid", architectures=("GraniteMoeHybridForCausalLM",),
           experts=True, moe_replay=True, megatron=False, no_compiled_layers=_MAMBA2,
           note="Mamba-2 tree state forks; Granite 4.0-H; recompute selective/full"),
    Family(name="Qwen3-Next", architectures=("Qwen3NextForCausalLM",), experts=True,
           moe_replay=True, megatron=False, no_compiled_layers=_GDN,
           note="Gated DeltaNet tree state forks (as Mamba-2's), gated attention, MoE with a "
                "shared expert; MTP refused"),
    Family(name="Qwen3.5", architectures=("Qwen3_5ForCausalLM",), megatron=False,
           no_compiled_layers=_GDN,
           note="text model; Gated DeltaNet tree state forks, gated attention; MTP refused"),
    Family(name="Qwen3.5-MoE", architectures=("Qwen3_5MoeForCausalLM",), experts=True,
           moe_replay=True, megatron=False, no_compiled_layers=_GDN,
           note="text model; as Qwen3.5, experts in every layer with a shared expert"),
)

# families read by nothing yet: {HF class: family name}
NOT_YET = {
    "Qwen3_5ForConditionalGeneration": "Qwen3.5 vision-language (its text model, "
                                       "Qwen3_5ForCausalLM, is read)",
    "Gemma3ForConditionalGeneration": "Gemma 3 vision-language (its text model, "
                                      "Gemma3ForCausalLM, is read)",
}

_BY_ARCH = {a: f for f in FAMILIES for a in f.architectures}


def family_of(architecture: str) -> Family:
    """The declared family of an HF class; ValueError naming it and what is supported."""
    family = _BY_ARCH.get(architecture)
    if family is None:
        raise ValueError(unsupported(architecture))
    return family


def unsupported(architecture) -> str:
    """One line: the family `architecture` belongs to (when known) and what is supported."""
    known = NOT_YET.get(architecture) if isinstance(architecture, str) else None
    what = f"{architecture} ({known})" if known else f"{architecture!r}"
    supported = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in FAMILIES)
    return f"model family {what} is not supported; treeflow reads {supported}"


def lacks(architecture: str, feature: str) -> str | None:
    """None when the family of `architecture` declares `feature` (a key of FEATURES), else
    the refusal: one line naming the family, the feature and the families that have it."""
    if feature not in FEATURES:
        raise AssertionError(f"unknown feature {feature!r}")
    family = family_of(architecture)
    if getattr(family, feature):
        return None
    having = [f.name for f in FAMILIES if getattr(f, feature)]
    why = family.why_not.get(feature)
    return (f"{family.name} ({architecture}): {FEATURES[feature][1]} is not supported yet; "
            f"families that have it: {', '.join(having)}" + (f"; why: {why}" if why else ""))


def require(architecture: str, feature: str) -> None:
    """ValueError with `lacks`'s line unless the family of `architecture` declares `feature`."""
    refusal = lacks(architecture, feature)
    if refusal is not None:
        raise ValueError(refusal)


def lacks_compiled_layers(architecture: str) -> str | None:
    """None when the family of `architecture` has compiled layers (Tuning(compile_layers)),
    else the refusal: one line naming the family, why, and what runs instead."""
    family = family_of(architecture)
    if not family.no_compiled_layers:
        return None
    having = [f.name for f in FAMILIES if f.recompute and not f.no_compiled_layers]
    return (f"{family.name} ({architecture}): compiled layers (Tuning(compile_layers), --tuning "
            f"compile_layers=1) are not supported: {family.no_compiled_layers}; leave "
            f"compile_layers off (recompute runs without it); families that have them: "
            f"{', '.join(having)}")


def _cell(f: Family, feature: str) -> str:
    if not getattr(f, feature):
        return "no"
    return "recompute only" if feature == "recompute" and f.no_compiled_layers else "yes"


def markdown_table() -> str:
    """README's compatibility table, one row per family, from the declarations above."""
    head = ["family", "HF class", "layouts (reference)", *(h for h, _ in FEATURES.values()),
            "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for f in FAMILIES:
        cells = [f.name, ", ".join(f"`{a}`" for a in f.architectures), " / ".join(LAYOUTS),
                 *(_cell(f, k) for k in FEATURES), f.note]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Not read yet (refused with this list): "
                 + "; ".join(f"{v} (`{k}`)" for k, v in NOT_YET.items()) + ".")
    return "\n".join(lines)


BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"


def readme_with_table(text: str) -> str:
    """`text` (README.md) with the part between BEGIN and END replaced by `markdown_table()`."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"README needs one {BEGIN} line before one {END} line")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}"


def write_readme(path) -> None:
    """Rewrite README.md's table at `path` (between BEGIN and END) from the declarations."""
    from treeflow.atomic import atomic_open

    with open(path) as f:
        new = readme_with_table(f.read())
    with atomic_open(path, "w") as f:
        f.write(new)
