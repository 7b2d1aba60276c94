"""GLM-4.5 (`Glm4MoeForCausalLM`) on the megatron backend = transformers call by call (CPU,
float32, TP=1).

MCore's own pieces run it: the sigmoid router with the expert bias added for the choice only
(`e_score_correction_bias` -> `router.expert_bias`), group-limited top-k, renormalised weights
scaled by routed_scaling_factor, shared experts without a gate, a dense first layer
(`moe_layer_freq` as a list), q/k norms, q/k/v biases and RoPE on half of each head (the
backend's angles are rotary_dim wide, MCore passes the rest through). The tiny model has 16
experts top-4 in 4 groups of 4 of which 2 are kept, so the group limit decides and MCore's
group score (its top top_k // topk_group = 2) is transformers' (its top 2); the bias is drawn
at 0.3 so it moves the choice (tests/models/families_helpers.py).

Replayed routes are transformers' own shifted by one expert, forced into its routers by an
independent patch (tests/models/hybrid_moe_helpers.py); recomputed routing is compared with
transformers unforced, so the router's own choice (bias, group limit) is checked too.
Logprobs within 1e-5 and every parameter gradient within 1e-5 of each tensor's largest entry
(the bounds of test_megatron_moe.py), tree / chain / exact in bins of at most 24 tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                    "pip install 'treeflow[megatron]' to run the megatron backend tests")

from tests.models.families_helpers import hf_deepseek, transformers  # noqa: E402
from tests.models.hybrid_moe_helpers import forced_routes, with_routes  # noqa: E402
from tests.models.moe_helpers import (episodes, hf_occurrence_logprobs,  # noqa: E402
                                      occurrence_logprobs)
from treeflow.models import load_backend  # noqa: E402
from treeflow.models.megatron import hf_to_mcore  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "megatron_group")  # conftest.py

GLM = dict(n_routed_experts=16, num_experts_per_tok=4)  # 4 groups of 4, 2 kept, top-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory, megatron_module_group):
    """(transformers model, its checkpoint dir, the megatron backend loaded from it)."""
    hf = hf_deepseek("glm4_moe", **GLM)
    path = tmp_path_factory.mktemp("glm4_moe")
    hf.save_pretrained(path)
    return hf, str(path), load_backend("megatron", str(path))


@pytest.fixture(scope="module")
def rows(pair):
    return with_routes(pair[0], episodes(np.random.default_rng(3)), shift=1)


def _hf_grads(hf, meg) -> dict:
    """transformers' parameter gradients under MCore's names (the correction bias is a buffer
    on both sides: no gradient)."""
    grads = {n: p.grad for n, p in hf.named_parameters()}
    grads.update({n: torch.zeros_like(b) for n, b in hf.named_buffers()
                  if n.endswith("e_score_correction_bias")})
    return {n: g for n, g in hf_to_mcore(grads, meg.config).items()
            if not n.endswith("router.expert_bias")}


@pytest.mark.parametrize("routing", ["replay", "recompute"])
def test_logprobs_and_gradients_match_transformers(pair, rows, routing):
    hf, _, meg = pair
    replay = routing == "replay"
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, rows, replay=replay, forced=forced_routes)
    rng = np.random.default_rng(7)
    w = {k: float(rng.uniform(0.5, 1.5)) for k in sorted(want)}
    hf.zero_grad()
    sum(w[k] * v for k, v in hf_occurrence_logprobs(hf, rows, replay=replay,
                                                     forced=forced_routes).items()).backward()
    want_grads = _hf_grads(hf, meg)
    for layout in ("tree", "chain", "exact"):
        meg.module.zero_grad()
        got, runner, _ = occurrence_logprobs(meg, rows, layout=layout, routing=routing,
                                             backend="megatron", max_tokens=24)
        agree, replayed = runner.take_route_tally()
        # the rows' routes are transformers' own shifted by one: replay follows them (the
        # router's own choice never equals them), recompute is transformers' own choice
        assert replayed > 0 and agree == 0, (layout, agree, replayed)
        assert got.keys() == want.keys()
        diff = max(abs(float(got[k].detach()) - float(want[k])) for k in want)
        assert diff < 1e-5, (layout, diff)
        sum(w[k] * v for k, v in got.items()).backward()
        params = dict(meg.module.named_parameters())
        assert params.keys() == want_grads.keys()
        assert any("shared_experts" in n for n in params) and any("q_layernorm" in n
                                                                  for n in params)
        for n, g in want_grads.items():  # an expert no row chose has a zero gradient
            scale = float(g.abs().max())
            assert params[n].grad is not None, (layout, n)
            assert float((params[n].grad - g).abs().max()) <= 1e-5 * scale + 1e-9, (layout, n)


def test_own_routes_agree_with_transformers(pair, rows):
    """transformers' own routes (shift 0) replayed: MCore's router chose every one itself."""
    hf, _, meg = pair
    own = with_routes(hf, episodes(np.random.default_rng(3)))
    with torch.no_grad():
        _, runner, _ = occurrence_logprobs(meg, own, layout="tree", routing="replay",
                                           backend="megatron", max_tokens=24)
    agree, replayed = runner.take_route_tally()
    assert replayed > 0 and agree == replayed


def test_export_round_trips_through_transformers(pair, tmp_path):
    hf, _, meg = pair
    meg.save(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "Glm4MoeForCausalLM"
    a, b = back.state_dict(), hf.state_dict()
    assert a.keys() == b.keys() and any(n.endswith("e_score_correction_bias") for n in b)
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0)


@pytest.mark.parametrize("over, match", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false: megatron-core's sigmoid router"),
    (dict(num_experts_per_tok=2), "top num_experts_per_tok // topk_group = 1 experts, "
                                  "transformers by its top 2"),
    (dict(max_position_embeddings=64, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=1e4,
        partial_rotary_factor=0.5)), "YaRN RoPE"),
])
def test_what_mcore_routes_otherwise_is_refused_by_name(tmp_path, over, match):
    hf_deepseek("glm4_moe", **{**GLM, **over}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        load_backend("megatron", str(tmp_path))


def test_mtp_layers_are_refused_by_name(tmp_path):
    """GLM-4.5 keeps MTP as an extra model.layers.{N}: 3 layers + 1 declared MTP layer."""
    hf_deepseek("glm4_moe", **GLM, num_hidden_layers=4).save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**d, "num_hidden_layers": 3, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match="checkpoint has MTP layers .* use --backend reference"):
        load_backend("megatron", str(tmp_path))


def test_cli_replay_and_train_with_the_megatron_backend(pair, tmp_path, capsys):
    """`--backend megatron` on GLM-4.5 through the CLI: the reference backend's logprobs and
    route agreement, and a training step."""
    import pyarrow.parquet as pq

    from treeflow.cli import main

    _, model, _ = pair
    eps = str(tmp_path / "ep.parquet")
    assert main(["synth", "-o", eps, "--episodes", "4", "--group-size", "2", "--max-turns", "3",
                 "--vocab-size", "61", "--routes-from", model, "--quiet"]) == 0
    got = {}
    for backend in ("reference", "megatron"):
        out = str(tmp_path / f"{backend}.parquet")
        assert main(["replay", eps, "--model", model, "--backend", backend, "--max-tokens",
                     "4096", "-o", out, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        lps = np.concatenate([np.concatenate(ep) for ep in pq.read_table(out).column("logprobs")
                              .to_pylist()])
        got[backend] = (lps, summary["route_agreement"])
    np.testing.assert_allclose(got["megatron"][0], got["reference"][0], rtol=0, atol=1e-5)
    assert got["megatron"][1] == pytest.approx(got["reference"][1], abs=1e-12)
    assert main(["replay", eps, "--model", model, "--backend", "megatron", "--mode", "train",
                 "--steps", "1", "--episodes-per-step", "4", "--max-tokens", "4096",
                 "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["last"]
    assert 0.0 <= last["route_agreement"] <= 1.0 and np.isfinite(last["loss"])


def test_deepseek_v3_is_refused_with_what_mcore_lacks(tmp_path):
    """MLA stays on the reference backend: the refusal names the family and MCore's reason."""
    hf_deepseek("deepseek_v3").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"DeepSeek-V3 \(DeepseekV3ForCausalLM\): the megatron "
                                         r"backend .*; why: megatron-core 0.16's multi-latent "
                                         r"attention builds its own rotary embedding"):
        load_backend("megatron", str(tmp_path))
