"""--config run.yaml|run.toml, --print-config, the config saved in checkpoints, loss flags."""

import json

import pytest

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 2), system_tokens=8,
                                  user_tokens=(3, 4), completion_tokens=(3, 4), tool_tokens=(3, 4),
                                  seed=4), path)
    return str(path)


YAML = "mode: train\nepisodes_per_step: 2\nsteps: 2\nloss: nll\nmax-tokens: 256\nlr: 1.0e-3\nquiet: true\n"
TOML = 'mode = "train"\nepisodes-per-step = 2\nsteps = 2\nloss = "nll"\nmax_tokens = 256\nlr = 1e-3\n'


@pytest.mark.parametrize("name,text", [("run.yaml", YAML), ("run.toml", TOML)])
def test_file_values_and_flags_override(data, tmp_path, capsys, name, text):
    (tmp_path / name).write_text(text)
    assert main(["replay", data, "--config", str(tmp_path / name), "--steps", "3",
                 "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)  # nested by option group (cli/groups.py)
    assert (cfg["train"]["mode"], cfg["data"]["episodes_per_step"], cfg["loss"]["loss"],
            cfg["layout"]["max_tokens"]) == ("train", 2, "nll", 256)
    assert cfg["train"]["steps"] == 3 and cfg["train"]["lr"] == 1e-3  # the flag wins
    # what --print-config prints is a config file again
    (tmp_path / "again.yaml").write_text(json.dumps(cfg))
    assert main(["replay", data, "--config", str(tmp_path / "again.yaml"), "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out) == cfg


@pytest.mark.parametrize("text,needle", [
    ("episode_per_step: 2\n", "'episode_per_step' is not an option of treeflow replay; did you mean --episodes-per-step?"),
    ("loss: ppo\n", "--loss takes one of nll, pg"),
    ("steps: 2.5\n", "not a valid value for --steps"),
    ("json: 3\n", "--json is a switch"),
    ("- a\n- b\n", "give a mapping"),
])
def test_bad_config_is_one_line(data, tmp_path, capsys, text, needle):
    (tmp_path / "bad.yaml").write_text(text)
    assert main(["replay", data, "--config", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config ") and err.count("\n") == 1 and needle in err, err


def test_checkpoint_holds_the_resolved_config(data, tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(YAML)
    ck = tmp_path / "ck"
    assert main(["replay", data, "--config", str(tmp_path / "run.yaml"), "--save", str(ck),
                 "--save-every", "1", "--entropy-coef", "0.01"]) == 0
    for step in ("step-000001", "step-000002"):
        assert "config.treeflow.json" in json.load(open(ck / step / "manifest.json"))["files"]
        cfg = json.load(open(ck / step / "config.treeflow.json"))
        assert (cfg["episodes_per_step"], cfg["loss"], cfg["entropy_coef"], cfg["files"]) == \
            (2, "nll", 0.01, [data])
    capsys.readouterr()


def test_kl_coef_refused_without_reference_logprobs(data, capsys):
    assert main(["replay", data, "--mode", "train", "--episodes-per-step", "2",
                 "--kl-coef", "0.1"]) == 2
    assert "--kl-coef 0.1: the KL penalty needs the reference" in capsys.readouterr().err
