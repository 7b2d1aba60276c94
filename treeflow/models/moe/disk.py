"""MoE tensors under their on-disk names: per-expert matrices and family renames.

transformers 5 holds experts fused in memory ([X, out, in] per projection) but
writes most families one matrix per expert, and some families under other
names than their modules'. `disk_name` maps a file's tensor name to the
model's (or to (fused prefix, expert, part) for one expert's matrix),
`fuse_experts` stacks those parts and `split_experts` is the inverse for
saving, so a saved checkpoint loads in transformers as the same model.

Per family: Qwen3-MoE / Qwen2-MoE store `mlp.experts.E.{gate,up,down}_proj`
(fused to `gate_up_proj` = [gate; up] and `down_proj`); Mixtral stores its
block as `block_sparse_moe.*` with experts w1/w3/w2 (gate, up, down);
Nemotron-H stores `mixer.experts.E.{up,down}_proj` (non-gated experts, fused
to `up_proj` and `down_proj`); GraniteMoeHybrid stores the fused tensors
already, as `block_sparse_moe.input_linear` / `output_linear`, and its router
as `router.layer`; gpt-oss stores its fused tensors under the model's names. DeepSeek-V3 and
GLM-4.5 store experts as Qwen3-MoE does.
"""

from __future__ import annotations

import torch

__all__ = ["disk_name", "fuse_experts", "split_experts"]

# family -> (experts infix in the model's names, on-disk part name -> part, fused name -> parts)
_SWIGLU = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
_SCHEMES = {
    "qwen": (".mlp.experts.", {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}, _SWIGLU),
    "mixtral": (".mlp.experts.", {"w1": "gate", "w3": "up", "w2": "down"}, _SWIGLU),
    "nemotron_h": (".mixer.experts.", {"up_proj": "up", "down_proj": "down"},
                   {"up_proj": ("up",), "down_proj": ("down",)}),
    "granitemoehybrid": None,  # fused on disk
    "gpt_oss": None,  # fused on disk (with biases), under the model's own names
}
# family -> [(on-disk substring, model substring)]
_RENAMES = {
    "mixtral": [(".block_sparse_moe.", ".mlp.")],
    "granitemoehybrid": [(".block_sparse_moe.input_linear.weight",
                          ".block_sparse_moe.experts.gate_up_proj"),
                         (".block_sparse_moe.output_linear.weight",
                          ".block_sparse_moe.experts.down_proj"),
                         (".block_sparse_moe.router.layer.weight",
                          ".block_sparse_moe.router.weight")],
}


def _scheme(moe):
    return _SCHEMES.get(moe.family, _SCHEMES["qwen"])


def _rename(name: str, moe, to_model: bool) -> str:
    for disk, model in _RENAMES.get(moe.family, ()):
        a, b = (disk, model) if to_model else (model, disk)
        name = name.replace(a, b)
    return name


def disk_name(name: str, moe) -> tuple[str, int, str] | str:
    """The model's name for an on-disk tensor name; (fused prefix, expert, part) for an
    expert's matrix."""
    name = _rename(name, moe, to_model=True)
    scheme = _scheme(moe)
    if scheme is None:
        return name
    infix, parts, _ = scheme
    head, sep, tail = name.partition(infix)
    if not sep:
        return name
    expert, _, rest = tail.partition(".")
    part = parts.get(rest.removesuffix(".weight"))
    if not expert.isdigit() or part is None or not rest.endswith(".weight"):
        return name  # a fused tensor (or an unknown one: the loader names it)
    return f"{head}{infix}", int(expert), part


def fuse_experts(parts: dict, moe, expected: dict) -> dict:
    """Per-expert tensors {(prefix, expert, part): [out, in]} -> the fused [X, out, in] ones."""
    _, _, fused = _scheme(moe)
    needed = [p for ps in fused.values() for p in ps]
    out = {}
    for prefix in sorted({p for p, _, _ in parts}):
        missing = [f"{prefix}{e}.{part}" for e in range(moe.num_experts)
                   for part in needed if (prefix, e, part) not in parts]
        if missing:
            raise ValueError(f"checkpoint lacks expert tensor(s) {missing[:4]} (of {len(missing)}); "
                             f"every one of the {moe.num_experts} experts needs "
                             f"{', '.join(needed)}")
        for fused_name, ps in fused.items():
            t = torch.cat([torch.stack([parts[(prefix, e, p)] for e in range(moe.num_experts)])
                           for p in ps], dim=1)
            name = prefix + fused_name
            if name not in expected:
                raise ValueError(f"unexpected expert tensors under {prefix!r} (shape "
                                 f"{tuple(t.shape)}): this layer has no experts in the config")
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"experts {prefix!r} give {fused_name} shape "
                                 f"{tuple(t.shape)} but the config needs {expected[name]}")
            out[name] = t
    return out


def split_experts(state: dict, moe) -> dict:
    """The inverse of `fuse_experts` + `disk_name`: the on-disk names and tensors."""
    scheme = _scheme(moe)
    out = {}
    for name, t in state.items():
        disk = _rename(name, moe, to_model=False)
        if scheme is None:
            out[disk] = t
            continue
        infix, parts, fused = scheme
        names = {v: k for k, v in parts.items()}
        head, sep, tail = name.partition(infix)
        if not sep or tail not in fused:
            out[disk] = t
            continue
        prefix = disk.removesuffix(tail)
        for part, piece in zip(fused[tail], t.chunk(len(fused[tail]), dim=1)):
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.{names[part]}.weight"] = piece[e].contiguous()
    return out
