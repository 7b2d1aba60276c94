"""Every saved step is a model directory an inference engine loads as is.

The source --model directory carries a tokenizer (built locally with `tokenizers`, no hub),
a chat template and a generation config; each step directory must hold copies listed in its
manifest, `latest` must be a relative symlink that transformers' from_pretrained opens, and
resume must still read the committed step (also from an old root whose `latest` is text).
"""

import json
import os

import pytest
import torch

from tests.io.conftest import build_tokenizer
from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes
from treeflow.train.checkpoint import latest_step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from treeflow.stages import EpisodeSchedule, Forward, Loss, Reduce
    from treeflow.train import Trainer

    d = str(tmp_path_factory.mktemp("policy"))
    Trainer(Forward(model="tiny"), Reduce(loss=Loss(kind="nll"),
                                          schedule=EpisodeSchedule(lr=1e-3))).backend.save(d)
    build_tokenizer(d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 1, "temperature": 0.7}, f)
    return d


def test_steps_are_complete_model_directories(model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    data = tmp_path / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 2), system_tokens=8,
                                  user_tokens=(3, 4), completion_tokens=(3, 4),
                                  tool_tokens=(3, 4), seed=2), data)
    ck = tmp_path / "ck"
    train = ["replay", str(data), "--mode", "train", "--model", model_dir, "--loss", "nll",
             "--episodes-per-step", "2", "--max-tokens", "256", "--save", str(ck), "--quiet"]
    assert main([*train, "--steps", "2", "--save-every", "1"]) == 0
    copied = [n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                          "chat_template.jinja", "generation_config.json")
              if os.path.exists(os.path.join(model_dir, n))]
    assert len(copied) >= 4
    for step in ("step-000001", "step-000002"):
        files = json.load(open(ck / step / "manifest.json"))["files"]
        for name in copied:
            assert name in files, (step, name)
            assert open(ck / step / name, "rb").read() == open(os.path.join(model_dir, name), "rb").read()
    assert os.path.islink(ck / "latest") and os.readlink(ck / "latest") == "step-000002"
    assert (ck / "latest.txt").read_text() == "step-000002\n"
    tok = AutoTokenizer.from_pretrained(str(ck / "latest"))
    want = AutoTokenizer.from_pretrained(model_dir)
    assert tok("List the files.")["input_ids"] == want("List the files.")["input_ids"]
    assert GenerationConfig.from_pretrained(str(ck / "latest")).temperature == 0.7
    model = AutoModelForCausalLM.from_pretrained(str(ck / "latest"), torch_dtype=torch.float32)
    from safetensors.torch import load_file

    saved = load_file(ck / "step-000002" / "model.safetensors")
    name = next(iter(saved))
    assert torch.equal(model.state_dict()[name], saved[name])
    # resume reads the record; a step resumed from carries the files on
    assert main([*train, "--steps", "3", "--resume", str(ck)]) == 0
    assert "chat_template.jinja" in json.load(open(ck / "step-000003" / "manifest.json"))["files"]
    assert os.readlink(ck / "latest") == "step-000003"
    capsys.readouterr()


def test_old_text_latest_still_resumes(tmp_path):
    root = tmp_path / "old"
    (root / "step-000004").mkdir(parents=True)
    (root / "latest").write_text("step-000004\n")  # the layout before latest.txt
    assert latest_step(str(root)) == 4
    (root / "latest.txt").write_text("step-000003\n")  # the record wins over the link
    os.remove(root / "latest")
    os.symlink("step-000004", root / "latest")
    assert latest_step(str(root)) == 3


def test_latest_is_a_text_record_where_symlinks_are_refused(tmp_path, monkeypatch):
    """A filesystem without symlinks: `latest` is written as a text file naming the step,
    and resume reads the step from it."""
    from treeflow.stages import Forward, Loss, Reduce
    from treeflow.train import Trainer

    def refuse(*args, **kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", refuse)
    tr = Trainer(Forward(model="tiny"), Reduce(loss=Loss(kind="nll")))
    root = tmp_path / "ck"
    tr.save(str(root))
    assert not os.path.islink(root / "latest")
    assert (root / "latest").read_text() == "step-000000\n" == (root / "latest.txt").read_text()
    assert latest_step(str(root)) == 0
    again = Trainer.resume(str(root), Forward(model="tiny"), Reduce(loss=Loss(kind="nll")))
    assert again.steps == 0 and again.checkpoint_path.endswith("step-000000")
