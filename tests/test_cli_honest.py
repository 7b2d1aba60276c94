"""The run says on stderr when it does something other than asked (--episodes-per-step)."""

import pytest

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "e.arrow"
    write_episodes(synth_episodes(episodes=8, group_size=4, turns=(2, 2), system_tokens=10,
                                  user_tokens=(3, 4), completion_tokens=(3, 4), tool_tokens=(3, 4),
                                  seed=5), path)
    return str(path)


@pytest.mark.parametrize("batch,said", [
    ("3", "trained 4 episodes; a step holds whole groups"),
    ("64", "trained 8 episodes; a step does not cross the end of the data"),
])
def test_batch_episodes_other_than_asked_is_said(data, capsys, batch, said):
    assert main(["replay", data, "--mode", "train", "--loss", "nll", "--episodes-per-step", batch,
                 "--steps", "2", "--max-tokens", "256", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"--episodes-per-step {batch}: step 1 {said}" in err
    assert err.count("--episodes-per-step") == 1  # once, not per step


def test_batch_episodes_as_asked_says_nothing(data, capsys):
    assert main(["replay", data, "--mode", "train", "--loss", "nll", "--episodes-per-step", "4",
                 "--steps", "1", "--max-tokens", "256", "--quiet"]) == 0
    assert "--episodes-per-step" not in capsys.readouterr().err


def _subcommands():
    from treeflow.cli import build_parser
    from treeflow.cli.config import subparsers

    return subparsers(build_parser())


from treeflow.cli.names import RENAMED

HIDDEN = {("stream", ("--linger",))}  # internal (tests' producer timing), hidden on purpose


def test_every_subcommand_takes_debug_and_quiet_and_documents_every_option():
    import argparse

    from treeflow.cli.groups import HelpFormatter

    subs = _subcommands()
    assert {"synth", "convert", "inspect", "plan", "replay", "stream", "rollout"} <= set(subs)
    for name, sub in subs.items():
        flags = {o for a in sub._actions for o in a.option_strings}
        assert {"--debug", "--quiet"} <= flags, name
        assert sub.formatter_class is HelpFormatter, name  # defaults shown once (groups.py)
        for a in sub._actions:
            if (name, tuple(a.option_strings)) in HIDDEN or set(a.option_strings) <= set(RENAMED):
                continue  # a renamed flag's old name is hidden (tests/test_cli_names.py)
            assert a.help and a.help != argparse.SUPPRESS, (name, a.option_strings or a.dest)


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 16384)" in out and "(default: tree)" in out


def test_debug_after_a_subcommand(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "e.arrow"),
                 "--format", "openai", "--debug"]) == 2  # refused for the missing file, not for --debug
    assert "unrecognized arguments" not in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,needle", [
    ("--lr", "-1", "--lr -1.0: give a finite number >= 0"),
    ("--steps", "0", "--steps 0: give the total number of optimizer steps"),
    ("--clip-low", "1.5", "--clip-low 1.5: give a number in [0, 1)"),
    ("--max-grad-norm", "0", "--max-grad-norm 0.0: give a finite number > 0"),
    ("--decay-episodes", "0", "--decay-episodes 0: give a number > 0"),
])
def test_training_numbers_are_refused_by_their_flag(data, capsys, flag, value, needle):
    assert main(["replay", data, "--mode", "train", flag, value]) == 2
    err = capsys.readouterr().err
    assert needle in err and "EpisodeSchedule(" not in err and "Reduce(" not in err, err


def test_output_off_a_terminal_is_not_hard_wrapped(tmp_path, capsys):
    """A path or a suggested command stays on one line when stdout is a pipe or a file."""
    import os

    deep = tmp_path / ("d" * 70)
    deep.mkdir()
    out = str(deep / "episodes.arrow")
    assert main(["synth", "-o", out, "--episodes", "4", "--group-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and out in lines[0], lines
    data = os.path.join(os.path.dirname(__file__), "data", "vllm_sglang.jsonl")
    converted = str(deep / "c.arrow")
    assert main(["convert", data, "-o", converted, "--format", "openai", "--episode-id-field",
                 "id", "--group-id-field", "meta.group", "--reward-field", "reward"]) == 0
    said = capsys.readouterr().out
    assert f"next: treeflow inspect {converted} --plot DIR" in said.splitlines()[-1], said
