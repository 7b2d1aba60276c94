"""Hybrid MoE checkpoints: saved back as transformers loads them, GraniteMoeHybrid's router aux
loss in a training step equal to the hand formula on transformers call by call, and the CLI
(synth --routes-from, replay --routing replay with the model's own routes: agreement 1.0)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch
from hybrid_helpers import HF_MAMBA_SEMANTICS, episodes, token_weights
from hybrid_moe_helpers import (FAMILIES, forced_routes, hf_model, hf_values, routers,
                               tf_values, with_routes)

from tests.deps import require
from tests.models.moe_helpers import hf_aux_and_nll
from treeflow.cli import main
from treeflow.models import load_backend, load_model, save_model
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Fragment, Pack

transformers = require("transformers", min_version="5.25", why=HF_MAMBA_SEMANTICS)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads_in_transformers_as_the_same_model(tmp_path, family):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "a")
    ours = load_model(tmp_path / "a")
    save_model(ours, tmp_path / "b")
    back = type(hf).from_pretrained(tmp_path / "b").eval()
    want, got = hf.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want
                                                             if not torch.equal(want[k], got[k])]


@pytest.mark.parametrize("layout", ["tree", "exact"])
def test_granite_router_aux_loss_equals_the_exact_baseline(tmp_path, layout):
    from treeflow.stages import Loss, Reduce
    from treeflow.train import Trainer

    hf = hf_model("granitemoehybrid", output_router_logits=True, router_aux_loss_coef=0.5)
    hf.save_pretrained(tmp_path)
    rows = with_routes(hf, episodes(9, seed=9).to_pylist(), shift=1)
    hf.zero_grad()
    want = hf_aux_and_nll(hf, rows, routers=routers, forced=forced_routes)
    want.backward()
    model = load_model(tmp_path)
    trainer = Trainer(Forward(routing="replay"), Reduce(loss=Loss(kind="nll")), model=model,
                      grad_sum="float64")
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    step = trainer.open_step(table)
    scope = "group" if layout == "tree" else None
    step.add(Fragment(max_tokens=24)(Pack(layout=layout, scope=scope)(table)))
    assert abs(step.loss_sum - float(want.detach())) < 1e-5 * abs(float(want.detach()))
    for n, p in hf.named_parameters():
        g, mine = p.grad.double(), step._grad64[n]
        assert float((mine - g).abs().max()) <= 1e-5 * float(g.abs().max()) + 1e-9, n
    step.abort()


def test_cli_replays_own_routes_with_full_agreement(tmp_path, capsys):
    hf = hf_model("nemotron_h_moe")
    hf.save_pretrained(tmp_path / "m")
    rows = with_routes(hf, episodes(9, seed=9).to_pylist())
    eps = tmp_path / "e.arrow"
    with pa.OSFile(str(eps), "wb") as f, pa.ipc.new_file(f, EPISODE_SCHEMA) as w:
        w.write_table(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    out = tmp_path / "o.arrow"
    assert main(["replay", str(eps), "--model", str(tmp_path / "m"), "--routing", "replay",
                 "--max-tokens", "24", "-o", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["route_agreement"] == 1.0
    got = pa.ipc.open_file(str(out)).read_all().to_pylist()
    worst = 0.0
    with torch.no_grad():
        for ep, row in zip(rows, got):
            for call, lp in zip(ep["calls"], row["logprobs"]):
                ids, s = torch.tensor([call["token_ids"]]), call["sampled_start"]
                with forced_routes(hf, np.asarray(call["routed_experts"])):
                    want = torch.log_softmax(hf(ids).logits[0].float(), -1)[s - 1:-1]
                want = want.gather(-1, ids[0, s:, None])[:, 0]
                worst = max(worst, float((torch.tensor(lp) - want).abs().max()))
    assert worst < 1e-5
    synth = tmp_path / "s.arrow"
    assert main(["synth", "-o", str(synth), "--episodes", "2", "--vocab-size", "61",
                 "--routes-from", str(tmp_path / "m"), "--quiet"]) == 0
    routes = pa.ipc.open_file(str(synth)).read_all().column("calls").to_pylist()[0][0]
    assert {len(r) for r in routes["routed_experts"]} == {4}  # 2 MoE blocks x top_k 2


def test_mission_class_hybrid_moe_with_mtp_trains_with_replay(tmp_path):
    """The validated model class: a Nemotron-H MoE hybrid with an MTP layer (attention + MoE,
    per-expert tensors under mtp.*) trained two steps with routing replay: the policy moves,
    every router learns, the MTP tensors stay bit-unchanged and are saved back under their
    own names."""
    import os

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from treeflow.stages import EpisodeSchedule, Loss, Reduce
    from treeflow.train import Trainer

    hf = hf_model("nemotron_h_moe", num_nextn_predict_layers=1)
    hf.save_pretrained(tmp_path / "src")
    file = os.path.join(tmp_path / "src", "model.safetensors")
    state = load_file(file)
    g = torch.Generator().manual_seed(3)
    mtp = {"mtp.layers.0.mixer.q_proj.weight": torch.randn(32, 32, generator=g).bfloat16(),
           "mtp.layers.1.mixer.gate.weight": torch.randn(6, 32, generator=g),
           **{f"mtp.layers.1.mixer.experts.{e}.up_proj.weight":
              torch.randn(16, 32, generator=g).bfloat16() for e in range(6)}}
    save_file({**state, **mtp}, file, metadata={"format": "pt"})
    rows = with_routes(hf, episodes(9, seed=9).to_pylist(), shift=1)
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    trainer = Trainer(Forward(model=str(tmp_path / "src"), routing="replay"),
                      Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2)))
    model = trainer.model
    assert set(model.frozen_tensors) == set(mtp)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        trainer.train_step(table, Fragment(max_tokens=24)(Pack(layout="tree",
                                                                scope="group")(table)))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {n for n in before if n.endswith("mixer.gate.weight")} <= moved  # routers learn
    for k, t in mtp.items():
        assert torch.equal(model.frozen_tensors[k].view(torch.uint8), t.view(torch.uint8)), k
    save_model(model, tmp_path / "out")
    with safe_open(os.path.join(tmp_path / "out", "model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert set(saved) == set(state) | set(mtp)
    assert all(saved[k].dtype == t.dtype and torch.equal(saved[k], t) for k, t in mtp.items())


def test_dense_granite_without_rope_matches_transformers(tmp_path):
    """GraniteMoeHybrid with num_local_experts 0 (its shared MLP alone) and Granite 4.0-H's
    position_embedding_type "nope" (no RoPE): tree with fragments = transformers per call."""
    hf = hf_model("granitemoehybrid", num_local_experts=0, position_embedding_type="nope")
    hf.save_pretrained(tmp_path)
    rows = episodes(9, seed=9).to_pylist()
    w = token_weights(validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA)))
    want, want_grads = hf_values(hf, rows, w, replay=False)
    backend = load_backend("reference", str(tmp_path))
    assert backend.config.moe is None
    vals, grads, _, _ = tf_values(backend, rows, w, layout="tree", max_tokens=24,
                                  routing="auto")
    assert max(abs(vals[k] - want[k]) for k in want) < 1e-5
    assert grads.keys() == want_grads.keys()
    for n, g in want_grads.items():
        assert float((grads[n] - g).norm() / g.norm()) < 1e-5, n
