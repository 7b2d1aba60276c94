"""models/support.py: every row of the table refuses its combination by name before a model
loads (the checkpoint holds only config.json, so a load would fail otherwise), and the context
parallelism page's table (docs/how-to/context-parallel.md) lists every row."""

from __future__ import annotations

import os

import pytest

from tests.deps import require
from treeflow.models import Tuning
from treeflow.models.support import ROWS
from treeflow.ops import build_forward
from treeflow.parallel import ParallelDims
from treeflow.stages import Forward

transformers = require("transformers")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A Nemotron-H (4 Mamba heads) as config.json alone: no weights to load."""
    from hybrid_moe_helpers import hf_config

    path = tmp_path_factory.mktemp("config-only")
    hf_config("nemotron_h_moe").save_pretrained(path)
    assert os.listdir(path) == ["config.json"]
    return str(path)


@pytest.mark.parametrize("fields,dims,needles", [
    ({}, ParallelDims(cp=5), ["--context-parallel 5", "mamba_num_heads=4", "4 or fewer"]),
    (dict(tuning=Tuning(recompute="mlp")), None, ["recompute='mlp'", "NemotronHForCausalLM"]),
    (dict(backend="megatron"), None, ["Nemotron-H (NemotronHForCausalLM): the megatron "
                                      "backend (--backend megatron) is not supported yet",
                                      "--backend reference"]),
], ids=["cp-above-heads", "recompute", "megatron"])
def test_hybrid_rows_refuse_before_the_model_loads(hybrid_dir, fields, dims, needles):
    forward = Forward(model=hybrid_dir, **fields)
    for call in (lambda: forward.check_model(dims), lambda: build_forward(forward, dims=dims)):
        with pytest.raises(ValueError) as err:
            call()
        assert all(n in str(err.value) for n in needles), str(err.value)
        assert hybrid_dir in str(err.value)


def test_a_hybrid_at_context_parallel_up_to_its_heads_is_not_refused(hybrid_dir):
    Forward(model=hybrid_dir).check_model(ParallelDims(cp=4))


def test_split_rows_check_the_engines_dims_not_the_forward():
    """Context and tensor parallelism are the engine's ParallelDims: the same Forward is
    refused under a split its backend cannot run, and accepted in one process."""
    megatron = Forward(backend="megatron")
    megatron.check_model()  # one process: nothing to refuse
    with pytest.raises(ValueError, match="context parallelism 2 .*--context-parallel"):
        megatron.check_model(ParallelDims(cp=2))
    reference = Forward()
    reference.check_model(ParallelDims(cp=2))
    with pytest.raises(ValueError, match="tensor parallelism 2 .*needs backend='megatron'"):
        reference.check_model(ParallelDims(tp=2))
    with pytest.raises(TypeError, match="give a treeflow.parallel.ParallelDims"):
        reference.check_model(2)


def test_the_docs_list_every_row():
    page = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "how-to",
                             "context-parallel.md")).read()
    missing = [row.what for row in ROWS if f"| {row.what} |" not in page]
    assert not missing, missing
