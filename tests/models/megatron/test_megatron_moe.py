"""MoE on the megatron backend (MCore's MoELayer) with routing replay = transformers per call.

Tiny random Qwen3-MoE / Qwen2-MoE / Mixtral models of transformers' own classes
(tests/models/moe_helpers.py); transformers runs one call at a time with the replayed
routes forced into *its* router module by the test's own patch. treeflow's megatron
backend (TP=1, EP=1, CPU, float32) runs the same episodes as tree, chain and exact bins.
Logprobs within 1e-5 and every parameter gradient, the routers' included, within 1e-5
relative (transformers' gradients mapped to MCore's names by the conversion functions,
which the round-trip test checks against transformers' own loading).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                    "pip install 'treeflow[megatron]' to run the megatron backend tests")

from tests.models.moe_helpers import (FAMILIES, episodes, hf_model,  # noqa: E402
                                      hf_occurrence_logprobs, occurrence_logprobs, with_routes)
from treeflow.models import load_backend  # noqa: E402
from treeflow.models.megatron import hf_to_mcore  # noqa: E402

LAYOUTS = ("tree", "chain", "exact")

# conftest.py: one thread; the group a backend makes torn down after the test or the module
pytestmark = pytest.mark.usefixtures("one_thread", "megatron_group")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory, megatron_module_group):
    """(transformers model, its checkpoint dir, the megatron backend loaded from it)."""
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, str(path), load_backend("megatron", str(path))


@pytest.fixture(scope="module")
def rows():
    return episodes(np.random.default_rng(3))


def _logprobs(meg, rows, *, layout, routing):
    """({(episode, call, offset): logprob}, runner) through Forward(backend="megatron")."""
    out, runner, _ = occurrence_logprobs(meg, rows, layout=layout, routing=routing,
                                         backend="megatron")
    return out, runner


@pytest.mark.parametrize("routing", ["replay", "recompute"])
def test_logprobs_and_gradients_match_transformers(pair, rows, routing):
    hf, _, meg = pair
    routed = with_routes(hf, rows, shift=1)  # perturbed: replay must follow them
    replay = routing == "replay"
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, routed, replay=replay)
    rng = np.random.default_rng(7)
    w = {k: float(rng.uniform(0.5, 1.5)) for k in sorted(want)}
    hf.zero_grad()
    sum(w[k] * v for k, v in hf_occurrence_logprobs(hf, routed, replay=replay).items()).backward()
    want_grads = hf_to_mcore({n: p.grad for n, p in hf.named_parameters()}, meg.config)
    for layout in LAYOUTS:
        meg.module.zero_grad()
        got, _ = _logprobs(meg, routed, layout=layout, routing=routing)
        assert got.keys() == want.keys()
        diff = max(abs(float(got[k].detach()) - float(want[k])) for k in want)
        assert diff < 1e-5, (layout, diff)
        sum(w[k] * v for k, v in got.items()).backward()
        params = {n: p for n, p in meg.module.named_parameters()}
        assert params.keys() == want_grads.keys()
        assert any("router" in n for n in params)
        for n, g in want_grads.items():
            mine = params[n].grad
            assert mine is not None, (layout, n)
            scale = float(g.abs().max())
            assert float((mine - g).abs().max()) <= 1e-5 * scale + 1e-9, (layout, n)


def test_replay_changes_results_and_agreement(pair, rows):
    hf, _, meg = pair
    own, shifted = with_routes(hf, rows), with_routes(hf, rows, shift=1)
    with torch.no_grad():
        got_own, _ = _logprobs(meg, own, layout="tree", routing="replay")
        agree_own = _agreement(meg, own)
        got_shift, _ = _logprobs(meg, shifted, layout="tree", routing="replay")
        agree_shift = _agreement(meg, shifted)
        got_rec, _ = _logprobs(meg, shifted, layout="tree", routing="recompute")
    assert max(abs(float(got_own[k]) - float(got_shift[k])) for k in got_own) > 1e-3
    assert max(abs(float(got_own[k]) - float(got_rec[k])) for k in got_own) < 1e-5
    assert agree_own == 1.0 and agree_shift < 0.5, (agree_own, agree_shift)


def _agreement(meg, rows):
    _, runner = _logprobs(meg, rows, layout="tree", routing="replay")
    agree, replayed = runner.take_route_tally()
    assert replayed > 0
    return agree / replayed


def test_export_round_trips_through_transformers(pair, tmp_path, rows):
    import transformers

    hf, _, meg = pair
    meg.save(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    a, b = back.state_dict(), hf.state_dict()
    assert a.keys() == b.keys()
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0)


def test_router_aux_loss_is_refused_by_name(tmp_path):
    hf_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.01).save_pretrained(
        tmp_path)
    with pytest.raises(ValueError, match="router aux loss .* megatron backend does not compute"):
        load_backend("megatron", str(tmp_path))


def test_cli_replay_and_train_with_the_megatron_backend(pair, tmp_path, capsys):
    """`--backend megatron` on an MoE checkpoint: the reference backend's logprobs and
    route agreement through the CLI, and a training step."""
    import json

    import pyarrow.parquet as pq

    from treeflow.cli import main

    hf, model, _ = pair
    if hf.config.model_type != "qwen3_moe":
        pytest.skip("the CLI path is the same for every family; Qwen3-MoE runs it")
    eps = str(tmp_path / "ep.parquet")
    assert main(["synth", "-o", eps, "--episodes", "4", "--group-size", "2", "--max-turns", "3",
                 "--vocab-size", "61", "--routes-from", model, "--quiet"]) == 0
    got = {}
    for backend in ("reference", "megatron"):
        out = str(tmp_path / f"{backend}.parquet")
        assert main(["replay", eps, "--model", model, "--backend", backend, "--max-tokens", "4096",
                     "-o", out, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        lps = np.concatenate([np.concatenate(ep) for ep in pq.read_table(out).column("logprobs")
                              .to_pylist()])
        got[backend] = (lps, summary["route_agreement"])
    np.testing.assert_allclose(got["megatron"][0], got["reference"][0], rtol=0, atol=1e-5)
    assert got["megatron"][1] == pytest.approx(got["reference"][1], abs=1e-12)
    assert main(["replay", eps, "--model", model, "--backend", "megatron", "--mode", "train",
                 "--steps", "1", "--episodes-per-step", "4", "--max-tokens", "4096", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["last"]
    assert 0.0 <= last["route_agreement"] < 1.0 and np.isfinite(last["loss"])


def test_tensor_and_expert_parallel_moe_need_cuda(tmp_path):
    """megatron-core 0.16.1's MoE dispatcher gathers tokens into a CUDA buffer for TP or EP > 1:
    refused on CPU by name (tests/gpu/test_gpu_megatron_moe.py runs them on two GPUs)."""
    hf_model("qwen3_moe", vocab_size=64).save_pretrained(tmp_path)
    for tp, ep in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match=f"tensor_parallel={tp}, expert_parallel={ep} needs CUDA"):
            load_backend("megatron", str(tmp_path), tensor_parallel=tp, expert_parallel=ep)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by expert_parallel=4"):
        load_backend("megatron", str(tmp_path), expert_parallel=4)
