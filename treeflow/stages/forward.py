"""Forward: bins -> per-edge logprobs, with the vocabulary projection only at loss edges.

Each bin runs as one sequence: embeddings and decoder layers over its nodes
with tree attention (positions = depths, each token sees its ancestors), the
final norm, then the hidden states of the edges' *sources* are gathered and
projected in chunks (`selected_logprobs`), so memory grows with edges, not
tokens x vocabulary. The stage's configuration names the model; the loaded
model, a runtime handle, is bound by the model-bound operator built from it
(treeflow/ops/forward.py; engines build it once per worker through the
planner's registry), never stored in the config.

Legend: N nodes of a bin, E its edges, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from treeflow.models.config.moe import ROUTINGS
from treeflow.models.tuning import Tuning
from treeflow.schemas.layout import BIN_SCHEMA, EDGE_VALUES_SCHEMA
from treeflow.stages.flat import list_offsets
from treeflow.stages.base import Stage

# torch is imported where a device or dtype is made, not with this module: the stage registry
# (ops/registry.py) imports every stage, and the Ray engine's stage actors, which run Pack,
# Fragment and Shard only, would each pay torch's import (1.4 CPU seconds) for nothing
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def __getattr__(name: str):
    if name == "DTYPES":  # {name: torch dtype}
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_device(device, *, what: str = "device") -> torch.device:
    """A torch.device, refusing a name torch does not know or CUDA where there is none."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{what} {device!r}: not a device torch knows; use cpu or cuda[:N]") \
            from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} {str(device)!r}: CUDA is not available here; use cpu")
    return dev


@dataclass(frozen=True, kw_only=True)
class Forward(Stage):
    """Run bins through a policy and give each loss edge its logprob (and entropy).

    model: "tiny" (built-in seeded model) or a local Hugging Face checkpoint dir.
    backend: "reference" (treeflow's PyTorch decoder) or "megatron" (megatron-core GPTModel).
    kernel: tree-attention kernel, "auto" | "dense" | "flex" | "causal" | "runs".
    How many processes split one bin (tensor parallelism on the megatron backend, context
    parallelism on the reference one: models/attention/context_parallel.py) is not configuration: it
    is the engine's ParallelDims (tp, cp), handed to `build_forward` with the group.
    context_overlap: under context parallelism, attend to a rank's own keys while the K/V
        exchange is in flight and merge the received part by log-sum-exp (default); False
        waits for the exchange and attends over all keys in one call (on CUDA only flex
        overlaps; runs and dense wait, with a warning).
    tuning: speed/memory levers of the reference backend (flex tiles, compiled
    layers, fused loss, recomputation; treeflow.models.Tuning); the default is
    the plain path.
    routing: MoE expert choice -- "replay" the bins' captured `routes` on every node
        (combine weights from the current router), "recompute" (the router chooses), or
        "auto": replay when the bins carry routes and the model has experts.
    allow_nonfinite: a NaN or inf logprob (or, in training, loss) is an error by default;
        True writes it (trains on it) with a warning on stderr instead.
    The device is not configuration: the engine passes it to `build`.
    """

    input_schema = BIN_SCHEMA
    output_schema = EDGE_VALUES_SCHEMA
    kind = "model"
    retired = {
        "context_parallel": "how many processes run one bin is the engine's now: "
                            "ParallelDims(cp=C) (RayEngine(dims=...) or LocalEngine(dims=...), "
                            "build_forward(dims=...)), or --context-parallel C",
        "tensor_parallel": "how many processes hold the model is the engine's now: "
                           "ParallelDims(tp=T) (LocalEngine(dims=...), build_forward(dims=...)),"
                           " or --tensor-parallel T",
    }

    model: str = "tiny"
    backend: str = "reference"
    dtype: str = "float32"
    kernel: str = "auto"
    chunk_size: int = 1024
    entropy: bool = False
    context_overlap: bool = True
    tuning: Tuning = Tuning()
    routing: str = "auto"
    allow_nonfinite: bool = False

    def __post_init__(self):
        from treeflow.models.config.model import BACKENDS

        if not isinstance(self.tuning, Tuning):
            raise ValueError(f"Forward(tuning={self.tuning!r}): give a treeflow.models.Tuning")
        if self.tuning != Tuning() and self.backend != "reference":
            raise ValueError(f"Forward(tuning=...) sets levers of the reference backend; backend "
                             f"{self.backend!r} has its own kernels: leave tuning at its default")

        if self.backend not in BACKENDS:
            raise ValueError(f"Forward(backend={self.backend!r}): choose one of {BACKENDS}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"Forward(dtype={self.dtype!r}): choose one of {sorted(DTYPE_NAMES)}")
        if self.kernel not in ("auto", "dense", "flex", "causal", "runs"):
            raise ValueError(f"Forward(kernel={self.kernel!r}): choose auto, dense, flex, causal or runs")
        if self.routing not in ROUTINGS:
            raise ValueError(f"Forward(routing={self.routing!r}): choose one of {ROUTINGS}")
        if self.chunk_size < 1:
            raise ValueError(f"Forward(chunk_size={self.chunk_size}): give an int >= 1")
        if not isinstance(self.context_overlap, bool):
            raise TypeError(f"Forward(context_overlap={self.context_overlap!r}): give True or "
                            "False")
        from treeflow.models.support import check

        check(self)  # models/support.py: what runs with what

    def produces(self) -> set[str]:
        """Per-edge values this forward gives (losses are checked against it)."""
        return {"edge_logprobs", "edge_entropies"} if self.entropy else {"edge_logprobs"}

    def vocab_size_hint(self) -> int:
        """The model's vocabulary size, read from its config, for validating input early."""
        return self.model_config().vocab_size

    def check_model(self, dims=None, *, shard_params: bool = False) -> None:
        """Refuse what this Forward cannot run with its model (models/support.py's table), from
        the model's config.json alone, split as `dims` (a ParallelDims: the engine's; None: one
        process), trained with sharded parameters if `shard_params`: call it before loading the
        model or sampling."""
        from treeflow.models.support import check

        check(self, self.model_config(), dims=dims, shard_params=shard_params)

    def model_config(self):
        """The model's shape (a treeflow.models.ModelConfig), read from its config.json."""
        from treeflow.models import ModelConfig

        if self.model == "tiny":
            return ModelConfig.tiny()
        return ModelConfig.from_hf_dir(self.model)

    def route_width_hint(self) -> int | None:
        """The `routed_experts` width episodes must have when routes are replayed, else None."""
        from treeflow.models import ModelConfig
        from treeflow.models.config.moe import route_width

        if self.routing == "recompute" or self.model == "tiny":
            return None
        return route_width(ModelConfig.from_hf_dir(self.model))

    def __call__(self, bins: pa.Table) -> pa.Table:
        raise TypeError("Forward is a configuration and holds no model: build its operator once "
                        "(runner = treeflow.ops.build_forward(Forward(...), device=...)) and call runner(bins), or run "
                        "it in a Pipeline")


def edge_values_table(bins: pa.Table, logprobs: list[np.ndarray], entropies) -> pa.Table:
    """Edge values of `bins` from per-bin arrays (one per row, in row order)."""
    def flat(parts):
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)

    return edge_values_flat(bins, flat(logprobs), None if entropies is None else flat(entropies))


def check_finite(bins: pa.Table, logprobs_E: np.ndarray, *, allow: bool) -> None:
    """FloatingPointError naming the first occurrence of a NaN/inf logprob (a warning if allowed)."""
    import sys

    finite = np.isfinite(logprobs_E)
    if finite.all():
        return
    bad = np.flatnonzero(~finite)
    offs = list_offsets(bins.column("edge_sources"))
    r = int(np.searchsorted(offs, bad[0], side="right") - 1)
    where = f"bin {bins.column('bin_id')[r].as_py()} of step {bins.column('step')[r].as_py()}"
    edge = int(bad[0] - offs[r])
    occ = bins.column("occ_edge")[r].values.to_numpy(zero_copy_only=False)
    hit = np.flatnonzero(occ == edge)
    if len(hit):
        o = int(hit[0])
        where += (f", sample_index {bins.column('occ_sample_index')[r].values[o].as_py()} call "
                  f"{bins.column('occ_call')[r].values[o].as_py()} sampled token "
                  f"{bins.column('occ_offset')[r].values[o].as_py()}")
    message = (f"{where}: {len(bad)} non-finite logprob(s) ({logprobs_E[bad[0]]}); the model gives "
               "NaN or inf (diverged or overflowing weights, or bfloat16 overflow)")
    if allow:
        print(f"warning: {message}; written as they are (--allow-nonfinite)", file=sys.stderr)
        return
    raise FloatingPointError(f"{message}: check --model and --dtype, or pass --allow-nonfinite "
                             "to write them anyway")


def edge_values_flat(bins: pa.Table, logprobs_E: np.ndarray, entropies_E) -> pa.Table:
    """Edge values of `bins` from all their edges' values, concatenated in row order."""
    offs = list_offsets(bins.column("edge_sources"))
    assert offs[-1] == len(logprobs_E), f"{len(logprobs_E)} edge values for {offs[-1]} edges"
    offs = pa.array(offs.astype(np.int32))

    def lst(values_E):
        return pa.ListArray.from_arrays(offs, pa.array(np.asarray(values_E, np.float32), pa.float32()))

    cols = {
        "step": bins.column("step"), "bin_id": bins.column("bin_id"),
        "edge_ids": bins.column("edge_ids"),
        "edge_logprobs": lst(logprobs_E),
        "edge_entropies": lst(entropies_E) if entropies_E is not None
        else pa.nulls(bins.num_rows, EDGE_VALUES_SCHEMA.field("edge_entropies").type),
        "occ_sample_index": bins.column("occ_sample_index"), "occ_call": bins.column("occ_call"),
        "occ_offset": bins.column("occ_offset"), "occ_edge": bins.column("occ_edge"),
    }
    return pa.Table.from_arrays([cols[f.name] for f in EDGE_VALUES_SCHEMA], schema=EDGE_VALUES_SCHEMA)
