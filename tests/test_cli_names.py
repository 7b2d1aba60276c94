"""One name per concept: the new flags, and the old ones accepted for one release with a warning."""

import json

import pytest

from treeflow.cli import build_parser, main
from treeflow.cli.config import subparsers
from treeflow.cli.names import RENAMED


def _config(capsys, argv):
    assert main(argv + ["--print-config"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), [line for line in out.err.splitlines() if line]


def test_every_old_flag_parses_into_the_new_one_on_every_command():
    parser = build_parser()
    seen = 0
    for name, sub in subparsers(parser).items():
        flags = {o: a for a in sub._actions for o in a.option_strings}
        for old, new in RENAMED.items():
            if new not in flags:
                continue
            assert old in flags, f"treeflow {name}: {new} without its old name {old}"
            assert flags[old].dest == flags[new].dest and flags[old].type == flags[new].type
            assert old not in sub.format_help(), f"treeflow {name} --help shows {old}"
            seen += 1
    assert seen >= 7  # replay, stream: both windows and ranks; inspect, plan: both


@pytest.mark.parametrize("old,new,value", [("--batch-episodes", "episodes_per_step", 3),
                                           ("--window", "episodes_per_step", 5),
                                           ("--ranks", "num_ranks", 2)])
def test_old_flag_sets_the_new_option_and_says_so_once(capsys, old, new, value):
    cfg, err = _config(capsys, ["replay", "e.arrow", "--mode", "train", old, str(value)])
    assert cfg[new] == value and not any(k in cfg for k in ("batch_episodes", "window", "ranks"))
    flag = "--" + new.replace("_", "-")
    assert err == [f"warning: {old} is renamed {flag}; the old name is accepted until the next "
                   "release"]


def test_new_flags_say_nothing(capsys):
    cfg, err = _config(capsys, ["replay", "e.arrow", "--mode", "train",
                                "--episodes-per-step", "3", "--num-ranks", "2"])
    assert (cfg["episodes_per_step"], cfg["num_ranks"]) == (3, 2) and err == []


def test_logprobs_window_defaults_and_training_has_none(capsys):
    assert _config(capsys, ["replay", "e.arrow"])[0]["episodes_per_step"] == 64
    assert _config(capsys, ["replay", "e.arrow", "--mode", "train"])[0]["episodes_per_step"] is None
    assert _config(capsys, ["stream", "--from", "e.arrow"])[0]["episodes_per_step"] == 64
    assert _config(capsys, ["plan", "e.arrow", "--max-tokens", "8"])[0]["episodes_per_step"] == 256


@pytest.mark.parametrize("mode,want", [("train", 2), ("logprobs", 7)])
def test_old_config_with_both_windows_takes_the_modes_one(tmp_path, capsys, mode, want):
    # what --print-config wrote before the rename: both windows, `ranks`
    (tmp_path / "old.yaml").write_text(f"mode: {mode}\nwindow: 7\nbatch_episodes: 2\nranks: 1\n")
    cfg, err = _config(capsys, ["replay", "e.arrow", "--config", str(tmp_path / "old.yaml")])
    assert (cfg["episodes_per_step"], cfg["num_ranks"]) == (want, 1)
    assert len(err) == 3 and all(line.startswith(f"warning: --config {tmp_path / 'old.yaml'}: ")
                                 for line in err)
    assert "'batch_episodes' is renamed 'episodes_per_step'" in err[1 if "window" in err[0] else 0]


def test_new_config_key_wins_over_an_old_one(tmp_path, capsys):
    (tmp_path / "c.toml").write_text('batch-episodes = 2\nepisodes_per_step = 9\nmode = "train"\n')
    cfg, err = _config(capsys, ["replay", "e.arrow", "--config", str(tmp_path / "c.toml")])
    assert cfg["episodes_per_step"] == 9 and len(err) == 1
    # and a flag wins over both
    cfg, _ = _config(capsys, ["replay", "e.arrow", "--config", str(tmp_path / "c.toml"),
                              "--batch-episodes", "4"])
    assert cfg["episodes_per_step"] == 4


def test_old_checkpoint_fingerprint_is_the_same_run():
    from treeflow.train.run import STEP_OPTIONS, differences

    now = {"data": [], "options": {k: None for k in STEP_OPTIONS} | {"episodes_per_step": 4}}
    saved = {"data": [], "options": {k: None for k in STEP_OPTIONS if k != "episodes_per_step"}
             | {"batch_episodes": 4}}
    assert differences(saved, now) == []
    saved["options"]["batch_episodes"] = 8
    assert differences(saved, now) == ["--episodes-per-step was 8, now 4"]
