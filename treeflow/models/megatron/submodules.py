"""Reading and replacing an MLP spec's submodules across megatron-core versions.

megatron-core 0.16 describes the MLP as a ModuleSpec; 0.19 builds it as
functools.partial(MLP.as_mlp_submodule, submodules=...). The dense spec (spec.py) and the
MoE spec (moe.py) both rewrite those submodules, so the two readers live here, below both.
"""

from __future__ import annotations

import dataclasses
import functools

__all__ = ["builder_module", "mlp_submodules", "with_mlp_submodules"]


def mlp_submodules(mlp):
    """The MLP's submodules: a ModuleSpec's (megatron-core 0.16) or a partial's (0.19 builds the
    MLP as functools.partial(MLP.as_mlp_submodule, submodules=...))."""
    if isinstance(mlp, functools.partial):
        return mlp.keywords["submodules"]
    return mlp.submodules


def with_mlp_submodules(mlp, submodules):
    if isinstance(mlp, functools.partial):
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    return dataclasses.replace(mlp, submodules=submodules)


def builder_module(spec):
    """The class (or builder function) a spec builds: a ModuleSpec's module (megatron-core 0.16)
    or a partial's function (0.19 builds experts as functools.partial(SequentialMLP, ...))."""
    return spec.func if isinstance(spec, functools.partial) else spec.module
