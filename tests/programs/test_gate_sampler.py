"""The gate's sampler holds its model only while it samples (programs/rollout.py, Memory).

While the trainer steps, no model the producer loaded is alive (watched: a weak reference to
each model the sampler loads, read with Trainer.train_step's arguments), and the figures say
so (`sampler.held_while_waiting_bytes` 0, one release, two loads). Releasing changes no
figure: the gate's float32 figures equal those of a sampler that keeps its model (its
`release` left out: the "before"), on the dense tiny model and on the tiny Nemotron-H MoE +
MTP hybrid under routing replay. Plant tried: a release that does nothing (the "before"
itself): the watch sees the model alive during the step.
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from treeflow.cli import main
from treeflow.programs import rollout
from treeflow.train import Trainer

SMALL = ["--threads", "1", "--prompt-tokens", "6", "10", "--completion-tokens", "3", "6",
         "--tool-tokens", "2", "4", "--timeout", "240", "--json"]


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def hybrid_moe_mtp(tmp_path_factory):
    """The design's gate model in miniature: Nemotron-H with MoE blocks and one MTP layer's
    tensors (as tests/models/ssm/test_hybrid_context_parallel_cli.py builds it)."""
    from tests.deps import require

    require("transformers")
    from safetensors.torch import load_file, save_file

    from tests.models.hybrid_moe_helpers import hf_model

    root = tmp_path_factory.mktemp("gate-sampler")
    hf_model("nemotron_h_moe", num_nextn_predict_layers=1).save_pretrained(root / "model")
    file = root / "model" / "model.safetensors"
    state = load_file(file)
    g = torch.Generator().manual_seed(3)
    state["mtp.layers.0.norm.weight"] = torch.randn(32, generator=g).to(torch.bfloat16)
    state["mtp.layers.0.eh_proj.weight"] = torch.randn(32, 64, generator=g)
    save_file(state, file, metadata={"format": "pt"})
    return str(root / "model")


def _gate(capsys, monkeypatch, *extra, release: bool = True):
    """The gate's figures, its stderr, and how many sampler models were alive at each
    trainer step (the watch)."""
    loaded: list[weakref.ref] = []
    alive_at_step: list[int] = []
    load, train_step = rollout._Sampler.load, Trainer.train_step

    def watched_load(self, source):
        load(self, source)
        loaded.append(weakref.ref(self.backend.module))

    def watched_step(self, *args, **kwargs):
        gc.collect()
        alive_at_step.append(sum(ref() is not None for ref in loaded))
        return train_step(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(rollout._Sampler, "load", watched_load)
        m.setattr(Trainer, "train_step", watched_step)
        if not release:
            m.setattr(rollout._Sampler, "release", lambda self: None)
        rc = main(["gate", *SMALL, *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1]), err, alive_at_step


@pytest.mark.parametrize("model", ["tiny", "hybrid"])
def test_the_sampler_releases_its_model_while_the_trainer_steps_and_no_figure_moves(
        model, capsys, monkeypatch, request):
    extra = (["--model", "tiny"] if model == "tiny" else
             ["--model", request.getfixturevalue("hybrid_moe_mtp"), "--group-size", "16",
              "--episodes", "16", "--routing", "replay"])
    after, err, alive = _gate(capsys, monkeypatch, *extra)
    assert after["passed"], err
    assert alive == [0], "a model the sampler loaded was alive while the trainer stepped"
    held = after["sampler"]
    assert held["weights_bytes"] > 0 and held["held_while_waiting_bytes"] == 0
    assert held["releases"] == 1 and held["loads"] == 2   # the initial model, the refit's
    assert "the sampler held" in err and "released while the trainer stepped" in err
    before, err, alive = _gate(capsys, monkeypatch, *extra, release=False)
    assert before["passed"], err
    assert alive == [1]   # the plant: the model kept is seen by the watch
    assert before["sampler"]["held_while_waiting_bytes"] == held["weights_bytes"]
    assert "the sampler kept" in err
    assert before["sampler"]["loads"] == 2 and before["sampler"]["releases"] == 0
    skip = {"seconds", "sampler"}
    assert {k: v for k, v in after.items() if k not in skip} == {
        k: v for k, v in before.items() if k not in skip}
    if model == "hybrid":
        assert after["route_agreement"] == 1.0 and after["route_near_ties"] == 0
