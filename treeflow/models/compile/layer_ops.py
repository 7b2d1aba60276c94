"""Compiled and recomputed execution of a decoder layer (the `Tuning` levers of a layer).

A layer is cut around its attention kernel into three parts: attention
inputs (input RMSNorm, q/k/v projections, RoPE, the cast to one dtype), the
attention output (o_proj and the residual add) and the MLP block
(post-attention RMSNorm, SwiGLU, residual add). The attention kernel itself
stays outside: FlexAttention is compiled on its own (attention/tree.py) and the
varlen/SDPA kernels are already fused.

- Compilation (`compile_layers`) compiles each part once with
  `torch.compile(fullgraph=True)` and the token count marked dynamic, so one
  graph per part serves every layer (parameters are graph inputs) and every
  bin length; what it buys is fused elementwise work (float32 RMSNorm
  statistics, RoPE, SiLU x up) and smaller saved activations. Without
  recomputation (and outside MoE layers) the attention output and the MLP
  block are one graph: two graphs per grad mode for dynamo to trace, not three.
  Where torch has the precompile API, each part is a `Precompiled` (compile/precompiled.py): its
  graphs are saved whole in the compile cache, so a later process loads them instead of
  tracing them again (without a cache, or without the API, plain torch.compile).
  A part takes the submodules it reads (norm, attention, MLP), never the whole layer: what
  selects its graph (the modules' structure, constants and tensor specs) is then what the graph
  computes with, so layers that differ only elsewhere share one build. An MoE layer's block
  holds its layer index, and with the whole layer as argument every MoE layer was a graph of its
  own: one AOTInductor build per layer and part (8 builds of 2 graphs, 79.2 s of a 4-layer
  Qwen3-MoE exact run's 85.2 s first compile on an H100). Trade-off: the parts name the layer's
  submodules (input_layernorm, self_attn, post_attention_layernorm, mlp), as the plain path does.
- Recomputation (`recompute`) wraps the MLP block or the attention half in
  non-reentrant activation checkpointing ("mlp", "attention"), or the whole
  layer ("full", "selective": compile/recompute.py, whose policies say what each keeps):
  backward reruns it from its input instead of keeping its intermediates.

With neither lever the decoder does not come here at all: its plain path is
the numerical reference. Legend: N tokens, H hidden, Q query heads, D head dim.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.utils.checkpoint import checkpoint

from treeflow.models.compile import precompiled
from treeflow.models.compile.recompute import LAYER_MODES, checkpoint_layer

__all__ = ["LayerOps", "layer_ops"]

_RECOMPILE_LIMIT = 64  # bins of one length share a graph; this bounds lengths x grad modes


class LayerOps:
    """How one layer runs: `ops(layer, x_NH, cos_ND, sin_ND, attention) -> x_NH`."""

    def __init__(self, *, compile_backend: str | None, recompute: str,
                 ahead_of_time: bool | None = None) -> None:
        self.compile_backend, self.recompute = compile_backend, recompute
        parts = (_attention_inputs, _attention_output, _mlp_block, _after_attention)
        # the tensor arguments whose first dimension is the token count (dynamic)
        tokens = ((2, 3, 4), (1, 2), (2,), (3, 4))
        # read without importing dynamo: a process that loads every graph ahead of time never
        # imports it (compile/aoti.py)
        # not inside a whole-layer checkpoint: torch's capture and its AOTAutograd cache fail
        # there (min-cut's cleanup_recompute_tags compares None > None; torch 2.13): plain
        # torch.compile then, which recompiles in each process instead of loading
        self.precompiled = (compile_backend is not None and precompiled.api_present()
                            and recompute not in LAYER_MODES)
        if self.precompiled:  # saved whole in the compile cache: a later process loads them
            parts = tuple(precompiled.Precompiled(f, backend=compile_backend, name=f.__name__[1:],
                                                  dynamic=d, recompile_limit=_RECOMPILE_LIMIT,
                                                  ahead_of_time=ahead_of_time,
                                                  eager_while_building=True)
                          for f, d in zip(parts, tokens))
        elif compile_backend is not None:
            parts = tuple(torch.compile(f, backend=compile_backend, dynamic=None, fullgraph=True)
                          for f in parts)
        self._inputs, self._output, self._mlp, self._after = parts
        # without recomputation nothing needs the MLP apart from the attention output: one graph
        # (o_proj through the MLP's residual) instead of two, one less for dynamo to trace
        self._fuse = compile_backend is not None and recompute == "none"

    def __repr__(self) -> str:
        return f"LayerOps(compile_backend={self.compile_backend!r}, recompute={self.recompute!r})"

    def __call__(self, layer, x_NH, cos_ND, sin_ND, attention, moe=None):
        if self.compile_backend is not None and not self.precompiled:  # Precompiled marks
            for t in (x_NH, cos_ND, sin_ND):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                return self._run(layer, x_NH, cos_ND, sin_ND, attention, moe)
        return self._run(layer, x_NH, cos_ND, sin_ND, attention, moe)

    def _run(self, layer, x_NH, cos_ND, sin_ND, attention, moe):
        grad = torch.is_grad_enabled()
        mark = self.compile_backend is not None and not self.precompiled
        if self._fuse and moe is None:
            out_NQD = attention(*self._inputs(layer.input_layernorm, layer.self_attn, x_NH,
                                              cos_ND, sin_ND))
            if mark:
                torch._dynamo.maybe_mark_dynamic(out_NQD, 0)
            return self._after(layer.self_attn, layer.post_attention_layernorm, layer.mlp, x_NH,
                               out_NQD)
        if grad and self.recompute in LAYER_MODES:
            return checkpoint_layer(self._layer, layer, x_NH, cos_ND, sin_ND, attention, moe,
                                    mode=self.recompute)
        if grad and self.recompute == "attention":
            x_NH = _checkpoint(self._attention, layer, x_NH, cos_ND, sin_ND, attention)
        else:
            x_NH = self._attention(layer, x_NH, cos_ND, sin_ND, attention)
        mlp = self._mlp if moe is None else _moe_block  # expert routing is data-dependent: eager
        parts = (layer.post_attention_layernorm, layer.mlp, x_NH, *(() if moe is None else (moe,)))
        if grad and self.recompute == "mlp":  # an MoE block keeps its top-k: never re-decided
            return _checkpoint(mlp, *parts) if moe is None else checkpoint_layer(
                mlp, *parts, mode="full")
        return mlp(*parts)

    def _attention(self, layer, x_NH, cos_ND, sin_ND, attention):
        out_NQD = attention(*self._inputs(layer.input_layernorm, layer.self_attn, x_NH, cos_ND,
                                          sin_ND))
        if self.compile_backend is not None and not self.precompiled:
            torch._dynamo.maybe_mark_dynamic(out_NQD, 0)
        return self._output(layer.self_attn, x_NH, out_NQD)

    def _layer(self, layer, x_NH, cos_ND, sin_ND, attention, moe=None):
        x_NH = self._attention(layer, x_NH, cos_ND, sin_ND, attention)
        norm, mlp = layer.post_attention_layernorm, layer.mlp
        return self._mlp(norm, mlp, x_NH) if moe is None else _moe_block(norm, mlp, x_NH, moe)


def _checkpoint(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def _attention_inputs(norm, attn, x_NH, cos_ND, sin_ND):
    return attn.inputs(norm(x_NH), cos_ND, sin_ND)


def _attention_output(attn, x_NH, out_NQD):
    return x_NH + attn.output(out_NQD)


def _mlp_block(norm, mlp, x_NH):
    return x_NH + mlp(norm(x_NH))


def _after_attention(attn, norm, mlp, x_NH, out_NQD):
    return _mlp_block(norm, mlp, _attention_output(attn, x_NH, out_NQD))


def _moe_block(norm, mlp, x_NH, moe):
    return x_NH + mlp(norm(x_NH), *moe)


def layer_ops(tuning, device: torch.device) -> LayerOps | None:
    """The LayerOps for `tuning` on `device`; None for the plain path (no lever on)."""
    if tuning is None or (not tuning.compile_layers and tuning.recompute == "none"):
        return None
    backend = tuning.compile_backend if tuning.compile_layers else None
    if backend == "inductor" and torch.device(device).type != "cuda":
        _warn_eager(torch.device(device).type)
        backend = None
    # (Precompiled checks dynamo's support where it falls back to torch.compile: importing
    # dynamo here would cost a process that loads every graph ahead of time 1.2 s)
    if backend is not None and not precompiled.api_present() \
            and not torch._dynamo.is_dynamo_supported():
        _warn_unsupported()
        backend = None
    if backend is None and tuning.recompute == "none":
        return None
    return _ops(backend, tuning.recompute)


@functools.cache
def _ops(backend: str | None, recompute: str) -> LayerOps:
    return LayerOps(compile_backend=backend, recompute=recompute)


@functools.cache
def _warn_eager(device_type: str) -> None:
    warnings.warn(f"Tuning(compile_layers=True) compiles with inductor on CUDA only; on "
                  f"{device_type} the layers run eager (set compile_backend='aot_eager' to "
                  "trace them anyway)", stacklevel=4)


@functools.cache
def _warn_unsupported() -> None:
    warnings.warn(f"Tuning(compile_layers=True): torch.compile is not supported with this "
                  f"Python/torch ({torch.__version__}); the layers run eager", stacklevel=4)
