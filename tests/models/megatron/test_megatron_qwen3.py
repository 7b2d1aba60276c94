"""Qwen3 dense on the megatron backend (MCore's GPT spec with `qk_layernorm=True`) =
transformers' Qwen3ForCausalLM call by call (CPU, float32, TP=1).

The same GRPO-group episodes as tests/models/reference/test_qwen3.py as tree, chain and exact bins;
logprobs within 1e-5 and every parameter gradient (q/k norms included) within 1e-5 of each
tensor's largest entry, transformers' gradients mapped to MCore's names by the conversion
that the export round trip checks against transformers' own loading.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                    "pip install 'treeflow[megatron]' to run the megatron backend tests")

from tests.models.families_helpers import hf_qwen3, transformers  # noqa: E402
from tests.models.moe_helpers import (episodes, hf_occurrence_logprobs,  # noqa: E402
                                      occurrence_logprobs)
from treeflow.models import load_backend  # noqa: E402
from treeflow.models.megatron import hf_to_mcore  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory, megatron_module_group):
    hf = hf_qwen3()
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return hf, load_backend("megatron", str(path))


def test_logprobs_and_gradients_match_transformers(pair):
    hf, meg = pair
    rows = episodes(np.random.default_rng(3))
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, rows, replay=False)
    rng = np.random.default_rng(7)
    w = {k: float(rng.uniform(0.5, 1.5)) for k in sorted(want)}
    hf.zero_grad()
    sum(w[k] * v for k, v in hf_occurrence_logprobs(hf, rows, replay=False).items()).backward()
    want_grads = hf_to_mcore({n: p.grad for n, p in hf.named_parameters()}, meg.config)
    assert any("q_layernorm" in n for n in want_grads)
    for layout in ("tree", "chain", "exact"):
        meg.module.zero_grad()
        got, _, _ = occurrence_logprobs(meg, rows, layout=layout, routing="auto",
                                        backend="megatron", max_tokens=24)
        assert got.keys() == want.keys()
        diff = max(abs(float(got[k].detach()) - float(want[k])) for k in want)
        assert diff < 1e-5, (layout, diff)
        sum(w[k] * v for k, v in got.items()).backward()
        params = dict(meg.module.named_parameters())
        assert params.keys() == want_grads.keys()
        for n, g in want_grads.items():
            scale = float(g.abs().max())
            assert scale > 0 and params[n].grad is not None, n
            assert float((params[n].grad - g).abs().max()) <= 1e-5 * scale, (layout, n)


def test_export_round_trips_through_transformers(pair, tmp_path):
    hf, meg = pair
    meg.save(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    a, b = back.state_dict(), hf.state_dict()
    assert a.keys() == b.keys()
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0)
