"""One name per concept: the new flags, and the old ones failing in one line naming the new."""

import json

import pytest

from treeflow.cli import build_parser, main
from treeflow.cli.config import subparsers
from treeflow.cli.names import RENAMED


def _config(capsys, argv):
    assert main(argv + ["--print-config"]) == 0
    out = capsys.readouterr()
    flat = {k: v for group in json.loads(out.out).values() for k, v in group.items()}
    return flat, [line for line in out.err.splitlines() if line]


def test_every_old_flag_is_known_hidden_and_refused_on_every_command(capsys):
    parser = build_parser()
    seen = 0
    for name, sub in subparsers(parser).items():
        flags = {o: a for a in sub._actions for o in a.option_strings}
        for old, new in RENAMED.items():
            if new not in flags:
                continue
            assert old in flags, f"treeflow {name}: {new} without its old name {old}"
            assert old not in sub.format_help(), f"treeflow {name} --help shows {old}"
            seen += 1
    assert seen >= 7  # replay, stream: both windows and ranks; inspect, plan: both


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_old_flag_fails_in_one_line_naming_the_new_one(capsys, old, new):
    for argv in ([old, "3"], [f"{old}=3"], [old]):
        assert main(["replay", "e.arrow", "--mode", "train", *argv]) == 2
        err = capsys.readouterr().err
        assert err == f"error: {old} is now {new} (the old name was accepted for one release)\n"


def test_new_flags_say_nothing(capsys):
    cfg, err = _config(capsys, ["replay", "e.arrow", "--mode", "train",
                                "--episodes-per-step", "3", "--num-ranks", "2"])
    assert (cfg["episodes_per_step"], cfg["num_ranks"]) == (3, 2) and err == []


def test_logprobs_window_defaults_and_training_has_none(capsys):
    assert _config(capsys, ["replay", "e.arrow"])[0]["episodes_per_step"] == 64
    assert _config(capsys, ["replay", "e.arrow", "--mode", "train"])[0]["episodes_per_step"] is None
    assert _config(capsys, ["stream", "--from", "e.arrow"])[0]["episodes_per_step"] == 64
    assert _config(capsys, ["plan", "e.arrow", "--max-tokens", "8"])[0]["episodes_per_step"] == 256


@pytest.mark.parametrize("text,old,new", [("mode: train\nwindow: 7\n", "window", "episodes_per_step"),
                                          ("batch-episodes = 2\n", "batch-episodes",
                                           "episodes_per_step"),
                                          ("ranks: 1\n", "ranks", "num_ranks")])
def test_old_config_key_fails_in_one_line_naming_the_new_one(tmp_path, capsys, text, old, new):
    path = tmp_path / ("old.toml" if "=" in text else "old.yaml")
    path.write_text(text)
    assert main(["replay", "e.arrow", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (f"error: --config {path}: '{old}' is now '{new}' (the old "
                                       "name was accepted for one release)\n")


def test_old_checkpoint_fingerprint_is_the_same_run():
    from treeflow.train.run import STEP_OPTIONS, differences

    now = {"data": [], "options": {k: None for k in STEP_OPTIONS} | {"episodes_per_step": 4}}
    saved = {"data": [], "options": {k: None for k in STEP_OPTIONS if k != "episodes_per_step"}
             | {"batch_episodes": 4}}
    assert differences(saved, now) == []
    saved["options"]["batch_episodes"] = 8
    assert differences(saved, now) == ["--episodes-per-step was 8, now 4"]
