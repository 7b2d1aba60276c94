"""DeepSeek-V3 (MLA) and GLM-4.5: sigmoid-routed, group-limited MoE with shared experts and a
dense first layer, on trees = transformers call by call (float32).

Replayed routes are the models' own shifted by one expert (a perturbation replay must
follow), forced into transformers' routers by an independent patch
(hybrid_moe_helpers.forced_routes); every logprob and parameter gradient of tree / chain /
exact layouts, whole and in fragments. The routers' own choice (group limit, bias correction)
is checked twice: captured routes agree with treeflow's on every row, and recomputed routing
gives transformers' unforced logprobs on random forks through each tree kernel.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from family_checks import check_cli, check_forks, check_layouts, check_training
from models_helpers import random_forest

from tests.models.families_helpers import DEEPSEEK_FAMILIES, VOCAB, hf_deepseek
from tests.models.hybrid_moe_helpers import forced_routes, with_routes
from tests.models.moe_helpers import episodes, occurrence_logprobs
from treeflow.models import ModelConfig, load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

_ROWS: dict = {}


@pytest.fixture(scope="module", params=DEEPSEEK_FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, treeflow's decoder loaded from its saved checkpoint, the path)."""
    hf = hf_deepseek(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model(path), path


def _rows(hf, shift):
    key = (type(hf).__name__, shift)
    if key not in _ROWS:
        _ROWS[key] = with_routes(hf, episodes(np.random.default_rng(3)), shift=shift)
    return _ROWS[key]


def test_config_reads_the_family_and_refuses_what_it_cannot_honour(pair):
    hf, ours, path = pair
    c = ours.config
    assert type(ours).__name__ == "DeepseekDecoder"
    assert c.moe.moe_layers == (1, 2) and (c.moe.n_group, c.moe.topk_group) == (4, 2)
    assert c.moe.shared_expert_intermediate_size == 16 and c.moe.routed_scaling_factor == 2.5
    assert c.rotary_dim == 8 and c.qk_norm == (not c.mla)  # GLM: half of 16; MLA: rope 8
    d = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    arch = d["architectures"][0]
    for key, value, what in [
            ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
            ("rope_parameters", {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e4},
             "rope_parameters.rope_type='llama3'"),
            ("scoring_func", "softmax", "scoring_func='softmax'"),
            ("moe_layer_freq", 2, "moe_layer_freq=2"),
            ("n_shared_experts", 0, "n_shared_experts=0")]:
        with pytest.raises(ValueError, match=rf"{arch} config uses {what}"):
            ModelConfig.from_hf_dict({**d, key: value})


@pytest.mark.parametrize("max_tokens", [24, 4096])
def test_replayed_logprobs_and_gradients_match_transformers(pair, max_tokens):
    """Shifted routes replayed: tree / chain / exact, fragments under 24 tokens or whole;
    every gradient (routers, experts, shared experts, MLA's latents) to 1e-5 relative."""
    hf, ours, _ = pair
    check_layouts(hf, ours, _rows(hf, 1), max_tokens=max_tokens, kernel="auto",
                  fragmented=max_tokens == 24, forced=forced_routes)


def test_captured_routes_agree_and_recompute_matches_transformers(pair):
    """The models' own routes (transformers' group-limited, bias-corrected choice) agree with
    treeflow's on every row; recomputed routing = transformers unforced, layouts and grads."""
    hf, ours, _ = pair
    _, runner, _ = occurrence_logprobs(ours, _rows(hf, 0), layout="tree", routing="replay")
    agree, total = runner.take_route_tally()
    assert total > 0 and agree == total
    _, runner, _ = occurrence_logprobs(ours, _rows(hf, 1), layout="tree", routing="replay")
    agree, total = runner.take_route_tally()
    assert agree < total / 2  # the shifted routes really differ
    check_layouts(hf, ours, episodes(np.random.default_rng(3)), max_tokens=24, kernel="auto",
                  fragmented=True)


@pytest.mark.parametrize("kernel", ["dense", "runs", "flex"])
def test_random_forks_match_transformers(pair, kernel):
    hf, ours, _ = pair
    tokens, parents = random_forest(np.random.default_rng(11), 40, vocab=VOCAB, extend=0.7)
    check_forks(hf, ours, tokens, parents, kernel)


def test_mla_variants_and_yarn_match_transformers(tmp_path):
    """MLA variants: a full q_proj (q_lora_rank null), values wider than query/key heads (q/k
    padded, q rescaled), rope on halves instead of interleaved pairs; YaRN as DeepSeek-V3's
    released config has it (factor 4 over 8 original positions, the blend active at these
    depths; mscale != mscale_all_dim: cos/sin and the softmax both rescaled)."""
    hf = hf_deepseek("deepseek_v3", seed=1, q_lora_rank=None, v_head_dim=28,
                     rope_interleave=False, max_position_embeddings=64, rope_parameters={
                         "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                         "original_max_position_embeddings": 8, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5})
    hf.save_pretrained(tmp_path)
    tokens, parents = random_forest(np.random.default_rng(12), 30, vocab=VOCAB, extend=0.7)
    check_forks(hf, load_model(tmp_path), tokens, parents, "dense")


def test_training_step_equals_transformers_and_saves_back(pair, tmp_path):
    hf, ours, path = pair
    changed = "self_attn.kv_b_proj" if ours.config.mla else "self_attn.q_norm"
    check_training(hf, path, episodes(np.random.default_rng(3)), tmp_path, kernel="auto",
                   changed=changed)


def test_cli_replay_and_train(pair, tmp_path, capsys):
    hf, _, path = pair
    check_cli(hf, path, tmp_path, capsys)


@pytest.mark.parametrize("tuning", ["recompute=full", "recompute=selective", "recompute=attention",
                                    "recompute=mlp", "compile_layers=1,compile_backend=aot_eager"])
def test_layer_levers_replay_as_transformers(pair, tuning):
    """Tuning's recompute and compile levers run MLA and the MoE blocks through layer_ops.py:
    replayed logprobs and every gradient = transformers with the routes forced (fragments)."""
    from tests.models.hybrid_moe_helpers import hf_values, tf_values
    from treeflow.models import Tuning, load_backend

    hf, _, path = pair
    rows = _rows(hf, 1)
    keys = sorted(occurrence_logprobs(load_model(path), rows, layout="exact",
                                      routing="replay")[0])
    w = {k: 0.5 + (i % 7) / 7 for i, k in enumerate(keys)}
    want, want_grads = hf_values(hf, rows, w, replay=True)
    backend = load_backend("reference", str(path), tuning=Tuning.parse(tuning))
    vals, grads, bins, _ = tf_values(backend, rows, w, layout="tree", max_tokens=24)
    assert bins > 2 and vals.keys() == want.keys()
    assert max(abs(vals[k] - want[k]) for k in want) < 1e-5
    assert grads.keys() == want_grads.keys()
    for n, g in want_grads.items():
        assert float((grads[n] - g).abs().max()) <= 1e-5 * float(g.abs().max()), n


def test_the_megatron_backend_is_refused_by_name(pair):
    """DeepSeek-V3 by its family; GLM-4.5 runs there (tests/models/megatron/test_megatron_glm.py)
    but not this config's group limit, which MCore scores otherwise (top 2 // 2 = 1)."""
    from treeflow.models import load_backend

    _, ours, path = pair
    arch = ours.config.architecture
    pytest.importorskip("megatron.core")
    match = (rf"DeepSeek-V3 \({arch}\): the megatron backend" if ours.config.mla else
             "megatron-core scores an expert group by its top num_experts_per_tok // topk_group")
    with pytest.raises(ValueError, match=match):
        load_backend("megatron", str(path))


def test_mtp_layers_past_the_decoder_are_held_frozen_and_saved_back(tmp_path):
    """GLM-4.5 / DeepSeek-V3 keep MTP as extra model.layers.{N+k}: a checkpoint of 3 layers
    plus one declared MTP layer loads with that layer frozen (never run), saves it back byte
    for byte, and runs as transformers' 3-layer model."""
    from safetensors import safe_open

    from treeflow.models import save_model

    hf4 = hf_deepseek("glm4_moe", num_hidden_layers=4)
    hf4.save_pretrained(tmp_path / "m")
    d = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {**d, "num_hidden_layers": 3, "num_nextn_predict_layers": 1}))
    ours = load_model(tmp_path / "m")
    assert ours.frozen_tensors and all(k.startswith("model.layers.3.")
                                       for k in ours.frozen_tensors)
    save_model(ours, tmp_path / "back")
    with safe_open(tmp_path / "m" / "model.safetensors", "pt") as a, \
            safe_open(tmp_path / "back" / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in ours.frozen_tensors:
            assert torch.equal(a.get_tensor(k), b.get_tensor(k))
    hf3 = hf_deepseek("glm4_moe", num_hidden_layers=3)
    hf3.load_state_dict({k: v for k, v in hf4.state_dict().items()
                         if not k.startswith("model.layers.3.")})
    tokens, parents = random_forest(np.random.default_rng(13), 20, vocab=VOCAB, extend=0.7)
    check_forks(hf3, ours, tokens, parents, "dense")
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {**d, "num_hidden_layers": 3, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.3\."):
        load_model(tmp_path / "m")


def test_cli_replays_synthesized_routes_as_transformers_forced(pair, tmp_path, capsys):
    """Episodes with routes of the checkpoint's shape (`synth --routes-from DIR`'s
    `routes_like`, at small sizes), then `treeflow replay --routing replay`: every logprob =
    transformers call by call with the episodes' routes forced into its routers."""
    check_cli_routes(pair[0], pair[2], tmp_path, capsys)


def check_cli_routes(hf, path, tmp_path, capsys) -> None:
    import pyarrow as pa

    from tests.models.moe_helpers import hf_call_logprobs
    from treeflow.cli import main

    from treeflow.tools import synth_episodes, write_episodes
    from treeflow.tools.synth import routes_like

    eps, out = str(tmp_path / "e.arrow"), str(tmp_path / "lp.arrow")
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=10,
                                  user_tokens=(2, 5), completion_tokens=(2, 6),
                                  tool_tokens=(2, 5), branch_prob=0.3, vocab_size=VOCAB,
                                  seed=2, **routes_like(str(path))), eps)
    assert main(["replay", eps, "--model", str(path), "--layout", "tree", "--max-tokens", "48",
                 "--routing", "replay", "--json", "-o", out]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= summary["route_agreement"] < 1.0  # synthesized routes, not the model's own
    got = np.concatenate([np.concatenate(r["logprobs"]) for r in
                          pa.ipc.open_file(out).read_all().to_pylist()])
    with torch.no_grad():
        want = np.concatenate([
            hf_call_logprobs(hf, c["token_ids"], c["sampled_start"],
                             np.asarray(c["routed_experts"]), forced=forced_routes).numpy()
            for r in pa.ipc.open_file(eps).read_all().to_pylist() for c in r["calls"]])
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", [pytest.param("glm4_moe", marks=pytest.mark.slow),
                                    "deepseek_v3"])  # ~35 s each on the shared CPU machine
def test_replay_under_context_parallel_2_equals_transformers(tmp_path, family):
    """Under --context-parallel 2 (gloo, CPU): the step's token-mean NLL and every gradient
    summed over the group = the hand formula on transformers call by call with the shifted
    routes forced."""
    from tests.models.moe_helpers import hf_call_logprobs
    from tests.models.moe.test_moe_context_parallel import cp_step
    from treeflow.train.launch import spawn

    hf = hf_deepseek(family)
    hf.save_pretrained(tmp_path)
    routed = _rows(hf, 1)
    hf.zero_grad()
    lps = [hf_call_logprobs(hf, c["token_ids"], c["sampled_start"],
                            np.asarray(c["routed_experts"]), forced=forced_routes)
           for r in routed for c in r["calls"]]
    want = -torch.cat(lps).mean()
    want.backward()
    ranks = spawn(cp_step, 2, str(tmp_path), routed, timeout_s=240, threads=1)
    assert all(r["tally"] is not None and r["tally"][1] > 0 for r in ranks)  # both replayed
    for r in ranks:
        assert abs(r["loss"] - float(want.detach())) < 1e-5 * abs(float(want.detach()))
    for n, p in hf.named_parameters():
        g, mine = p.grad.double(), ranks[0]["grads"][n]
        assert float((mine - g).abs().max()) <= 1e-5 * float(g.abs().max()), n


def test_rollout_captures_the_routes_transformers_chooses(pair):
    check_rollout_routes(pair[0], pair[2])


def check_rollout_routes(hf, path) -> None:
    """The rollout sampler's route capture (programs/rollout.py, each block's own_routes) on a
    checkpoint: every call's routes = transformers' own routers' choice on that call, row by
    row but the final sampled token's (the sampler never ran it as an input)."""
    from tests.models.hybrid_moe_helpers import call_routes
    from treeflow.models import load_backend
    from treeflow.programs import Rollout, sample_group

    config = Rollout(group_size=2, turns=(1, 2), prompt_tokens=(6, 10), completion_tokens=(3, 6),
                     tool_tokens=(2, 4), seed=7)
    eps = sample_group(load_backend("reference", str(path)), config, 0)
    k = hf.config.num_experts_per_tok
    for call in (c for cs in eps.column("calls").to_pylist() for c in cs):
        got = np.asarray(call["routed_experts"])
        got = np.concatenate([np.sort(got[:, j:j + k], -1) for j in range(0, got.shape[1], k)],
                             -1)
        want = call_routes(hf, call["token_ids"])
        assert got.shape == want.shape and (got[:-1] == want[:-1]).all()
