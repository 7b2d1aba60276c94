"""Forward: bins -> per-edge logprobs, with the vocabulary projection only at loss edges.

Each bin runs as one sequence: embeddings and decoder layers over its nodes
with tree attention (positions = depths, each token sees its ancestors), the
final norm, then the hidden states of the edges' *sources* are gathered and
projected in chunks (`selected_logprobs`), so memory grows with edges, not
tokens x vocabulary. The stage's configuration names the model; the loaded
model, a runtime handle, is bound by `Forward.build` (engines call it once per
worker), never stored in the config.

Legend: N nodes of a bin, E its edges, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from treeflow.schemas.layout import BIN_SCHEMA, EDGE_VALUES_SCHEMA
from treeflow.stages._flat import list_offsets, list_values
from treeflow.stages.base import Stage
from treeflow.tree import subtree_end

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class Forward(Stage):
    """Run bins through a policy and give each loss edge its logprob (and entropy).

    model: "tiny" (built-in seeded model) or a local Hugging Face checkpoint dir.
    backend: "reference" (treeflow's PyTorch decoder) or "megatron" (megatron-core GPTModel).
    kernel: tree-attention kernel, "auto" | "dense" | "flex" | "causal" | "runs".
    """

    input_schema = BIN_SCHEMA
    output_schema = EDGE_VALUES_SCHEMA

    model: str = "tiny"
    backend: str = "reference"
    dtype: str = "float32"
    device: str = "cpu"
    kernel: str = "auto"
    chunk_size: int = 1024
    entropy: bool = False

    def __post_init__(self):
        from treeflow.models import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"Forward(backend={self.backend!r}): choose one of {BACKENDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Forward(dtype={self.dtype!r}): choose one of {sorted(DTYPES)}")
        if self.kernel not in ("auto", "dense", "flex", "causal", "runs"):
            raise ValueError(f"Forward(kernel={self.kernel!r}): choose auto, dense, flex, causal or runs")
        if self.chunk_size < 1:
            raise ValueError(f"Forward(chunk_size={self.chunk_size}): give an int >= 1")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"Forward(device={self.device!r}): CUDA is not available here; use cpu")

    def produces(self) -> set[str]:
        """Per-edge values this forward gives (losses are checked against it)."""
        return {"edge_logprobs", "edge_entropies"} if self.entropy else {"edge_logprobs"}

    def vocab_size_hint(self) -> int:
        """The model's vocabulary size, read from its config, for validating input early."""
        from treeflow.models import ModelConfig

        if self.model == "tiny":
            return ModelConfig.tiny().vocab_size
        return ModelConfig.from_hf_dir(self.model).vocab_size

    def build(self, model=None) -> "ForwardRunner":
        """Bind a model backend for running bins.

        model: None (load `self.model` into `self.backend`), a loaded Backend, or a
        reference Decoder (wrapped in the reference backend).
        """
        from treeflow.models import Backend, Decoder, ReferenceBackend, load_backend

        if model is None:
            backend = load_backend(self.backend, self.model, dtype=DTYPES[self.dtype],
                                   device=self.device)
        elif isinstance(model, Decoder):
            backend = ReferenceBackend(model)
        elif isinstance(model, Backend):
            backend = model
        else:
            raise TypeError(f"Forward.build(model=...) takes a Backend or a Decoder, got "
                            f"{type(model).__name__}")
        if backend.name != self.backend:
            raise ValueError(f"Forward(backend={self.backend!r}) was given a {backend.name!r} "
                             "model; build it with the matching backend")
        backend.train(False)
        return ForwardRunner(self, backend)

    def __call__(self, bins: pa.Table) -> pa.Table:
        return self.build()(bins)


class ForwardRunner:
    """A Forward stage bound to a loaded model backend (`model` is its torch module)."""

    def __init__(self, config: Forward, backend):
        self.config = config
        self.backend = backend
        self.model = backend.module
        self.vocab_size = backend.config.vocab_size
        self.device = torch.device(config.device)

    def edge_logprobs(self, tokens, parents, positions, sources, targets):
        """Logprobs (and entropies) of one bin's edges; differentiable when grad is enabled."""
        backend = self.backend
        plan = backend.attention_plan(parents, subtree_end(positions), kernel=self.config.kernel)
        tok = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)).to(self.device)
        pos = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(self.device)
        hidden_NH = backend.hidden_states(tok, pos, plan)
        src = torch.from_numpy(np.ascontiguousarray(sources, dtype=np.int64)).to(self.device)
        tgt = torch.from_numpy(np.ascontiguousarray(targets, dtype=np.int64)).to(self.device)
        return backend.edge_logprobs(hidden_NH[src], tgt, chunk_size=self.config.chunk_size,
                                     with_entropy=self.config.entropy)

    def __call__(self, bins: pa.Table) -> pa.Table:
        cols = {n: bins.column(n).combine_chunks() for n in ("tokens", "parents", "positions",
                                                             "edge_sources", "edge_targets")}
        off = {n: list_offsets(c) for n, c in cols.items()}
        val = {n: list_values(c) for n, c in cols.items()}
        for name in ("tokens", "edge_targets"):  # a trailing target is not a node of its bin
            big = np.flatnonzero(val[name] >= self.vocab_size)
            if len(big):
                r = int(np.searchsorted(off[name], big[0], side="right") - 1)
                raise ValueError(
                    f"bin {bins.column('bin_id')[r].as_py()} of step {bins.column('step')[r].as_py()} "
                    f"holds token id {int(val[name][big[0]])} >= the model's vocabulary size "
                    f"{self.vocab_size}; validate the episodes with vocab_size (treeflow replay "
                    "does) to find the episode, and use the tokenizer of this model")
        logprobs, entropies = [], []
        with torch.no_grad():
            for r in range(bins.num_rows):
                def get(n):
                    return val[n][off[n][r]:off[n][r + 1]]
                if len(get("edge_sources")) == 0:
                    logprobs.append(np.zeros(0, np.float32))
                    entropies.append(np.zeros(0, np.float32))
                    continue
                lp, ent = self.edge_logprobs(get("tokens"), get("parents"), get("positions"),
                                             get("edge_sources"), get("edge_targets"))
                logprobs.append(lp.float().cpu().numpy())
                entropies.append(ent.float().cpu().numpy() if ent is not None else None)
        return edge_values_table(bins, logprobs, entropies if self.config.entropy else None)


def edge_values_table(bins: pa.Table, logprobs: list[np.ndarray], entropies) -> pa.Table:
    counts = np.array([len(x) for x in logprobs], dtype=np.int64)
    offs = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))

    def lst(parts):
        vals = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
        return pa.ListArray.from_arrays(offs, pa.array(vals, pa.float32()))

    cols = {
        "step": bins.column("step"), "bin_id": bins.column("bin_id"),
        "edge_ids": bins.column("edge_ids"),
        "edge_logprobs": lst(logprobs),
        "edge_entropies": lst(entropies) if entropies is not None
        else pa.nulls(bins.num_rows, EDGE_VALUES_SCHEMA.field("edge_entropies").type),
        "occ_sample_index": bins.column("occ_sample_index"), "occ_call": bins.column("occ_call"),
        "occ_offset": bins.column("occ_offset"), "occ_edge": bins.column("occ_edge"),
    }
    return pa.Table.from_arrays([cols[f.name] for f in EDGE_VALUES_SCHEMA], schema=EDGE_VALUES_SCHEMA)
