"""Non-finite values stop the run (issue 20): one NaN in the weights gave NaN for every logprob.

NaN or inf in a loaded tensor is refused at load, naming it. Weights that are
finite but overflow (a diverged run) give non-finite logprobs: replay refuses
to write them, naming the bin and the sampled token, and a training step is
aborted with the weights and AdamW as they were -- unless --allow-nonfinite,
which warns on stderr instead.
"""

from __future__ import annotations

import pyarrow.ipc as ipc
import pytest
import torch

from tests.reliability.helpers import TRAIN, cli, small_episodes, tree_hashes, write_small
from treeflow.models import load_model, save_model
from treeflow.models.checkpoint import save_state


@pytest.fixture
def data(tmp_path):
    return write_small(tmp_path / "e.arrow")


def _model(tmp_path, name, edit):
    m = load_model("tiny")
    state = {k: v.clone() for k, v in m.state_dict().items()}
    edit(state)
    path = tmp_path / name
    save_model(m, path)
    save_state(state, m.config, path)
    return path


def _nan(state):
    state["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")


def _overflow(state):  # finite, but the logits overflow float32
    state["model.norm.weight"].fill_(3e38)


def test_nan_in_the_weights_is_refused_at_load(tmp_path, capsys, data):
    m = _model(tmp_path, "m", _nan)
    before = tree_hashes(tmp_path)
    for argv in (["replay", data, "--model", m, "-o", tmp_path / "o.arrow"],
                 ["replay", data, "--model", m, *TRAIN, "--save", tmp_path / "ck"]):
        rc, _, err = cli(capsys, *argv)
        assert rc == 2 and err.startswith("error:") and err.count("\n") == 1, err
        assert "'model.layers.1.mlp.down_proj.weight'" in err and "non-finite" in err, err
    assert tree_hashes(tmp_path) == before


def test_non_finite_logprobs_are_not_written(tmp_path, capsys, data):
    m = _model(tmp_path, "m", _overflow)
    out = tmp_path / "o.arrow"
    rc, _, err = cli(capsys, "replay", data, "--model", m, "-o", out, "--quiet")
    assert rc == 2 and err.count("\n") == 1, err
    assert "non-finite logprob" in err and "sample_index" in err and "--allow-nonfinite" in err
    assert not out.exists()
    rc, _, err = cli(capsys, "replay", data, "--model", m, "-o", out, "--quiet", "--allow-nonfinite")
    assert rc == 0 and "warning:" in err and "non-finite logprob" in err, err
    lp = ipc.open_file(out).read_all().column("logprobs").to_pylist()
    assert any(v != v for ep in lp for call in ep for v in call)  # NaN written, as asked


def test_a_step_with_non_finite_logprobs_is_aborted_unchanged(tmp_path):
    from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce
    from treeflow.train import Trainer

    episodes = small_episodes(4)
    reduce = Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=1e-2))
    trainer = Trainer(Forward(model=str(_model(tmp_path, "m", lambda s: None))), reduce)
    bins = Fragment(max_tokens=256)(Pack()(episodes))
    trainer.train_step(episodes, bins)  # a good step: AdamW has state
    with torch.no_grad():
        trainer.model.model.norm.weight.fill_(3e38)
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    adam = {(i, k): v.clone() for i, st in trainer.optimizer.state.items()
            for k, v in st.items() if torch.is_tensor(v)}
    with pytest.raises(FloatingPointError, match="non-finite logprob"):
        trainer.train_step(episodes, bins)
    assert not trainer.step_open and trainer.steps == 1
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())
    now = {(i, k): v for i, st in trainer.optimizer.state.items() for k, v in st.items()
           if torch.is_tensor(v)}
    assert now.keys() == adam.keys() and all(torch.equal(adam[k], now[k]) for k in adam)
    assert all(p.grad is None for p in trainer.model.parameters())


def test_training_cli_stops_on_non_finite_logprobs(tmp_path, capsys, data):
    m = _model(tmp_path, "m", _overflow)
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, "--model", m, *TRAIN, "--save", ck)
    assert rc == 2 and err.count("\n") == 1, err
    assert "step 1" in err and "non-finite logprob" in err and "weights and AdamW unchanged" in err
    assert not ck.exists() or not any(n.startswith("step-") for n in ck.iterdir())
