"""Every command's parser walked: each option in one named group, each help line with at most
one default, each group a config key, and --print-config read back by --config as the same
parsed options (treeflow/cli/groups.py)."""

import argparse
import json
import re

import pytest

from treeflow.cli import build_parser, main
from treeflow.cli.config import apply_config, subparsers
from treeflow.cli.groups import GROUPS, HelpFormatter

# what each command needs on its command line (positionals and required flags stay there), and
# options that differ from the defaults, so the round trip carries values, not only defaults
COMMANDS = {
    "synth": (["-o", "e.arrow"], ["--episodes", "8", "--branch-prob", "0.5", "--quiet"]),
    "convert": (["l.jsonl", "-o", "e.arrow", "--format", "openai"],
                ["--reward-field", "r", "--no-logprobs", "--batch-rows", "3"]),
    "inspect": (["e.arrow"], ["--max-tokens", "64", "--num-ranks", "2", "--json"]),
    "plan": (["e.arrow", "--max-tokens", "64"], ["--scope", "episode", "--rank", "1"]),
    "replay": (["e.arrow"], ["--mode", "train", "--episodes-per-step", "4", "--dtype", "bfloat16",
                             "--no-std-normalize", "--advantage", "grpo", "--num-ranks", "2",
                             "--logger", "mlflow", "--logger", "console,wandb", "--lr", "0.5",
                             "--tensor-parallel", "2", "--keep", "3", "-o", "x.arrow"]),
    "stream": ([], ["--from", "a.arrow", "b.arrow", "--mode", "train", "--queue", "q",
                    "--max-staleness", "2", "--lease", "per-rank", "--steps", "3"]),
    "rollout": ([], ["--queue", "q", "--turns", "3", "5", "--temperature", "0.5", "--no-close"]),
    "gate": ([], ["--tuning", "fast", "--turns", "2", "2", "--max-gen-kl", "0.1",
                  "--context-parallel", "2"]),
}
INTERNAL = {"config", "print_config", "help", "debug", "verbose"}  # never written to a config


def _subs():
    return subparsers(build_parser())


def _entry(sub, action) -> str:
    """The action's --help entry as printed, on one line."""
    formatter = sub._get_formatter()
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def malformed_defaults(sub) -> list:
    """Help entries with two defaults, an empty one, None, or a switch's True/False."""
    bad = []
    for action in sub._actions:
        if action.help is argparse.SUPPRESS:
            continue
        text = _entry(sub, action)
        said = re.findall(r"\(default\b|\bdefault:", text)
        if (len(said) > 1 or "(default: )" in text or "(default: None)" in text
                or (action.nargs == 0 and re.search(r"\(default: (True|False)\)", text))):
            bad.append(text)
    return bad


def test_every_command_is_covered():
    assert set(COMMANDS) == set(_subs())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_in_a_named_group(name):
    sub = _subs()[name]
    where = {}
    for group in sub._action_groups:
        for action in group._group_actions:
            where.setdefault(action.dest + repr(action.option_strings), []).append(group.title)
    for action in sub._actions:
        homes = where.get(action.dest + repr(action.option_strings), [])
        assert len(homes) == 1 and homes[0] in GROUPS, (name, action.option_strings, homes)
    # and --help shows the groups, in GROUPS' order
    text = sub.format_help()
    shown = [t for t in GROUPS if re.search(rf"^{t}:$", text, re.M)]
    assert shown and shown == sorted(shown, key=list(GROUPS).index), (name, shown)
    assert not re.search(r"^(options|positional arguments):$", text, re.M), name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_help_entry_says_its_default_once(name):
    assert malformed_defaults(_subs()[name]) == []


def test_the_check_catches_a_doubled_default():
    """The plant: argparse's own formatter on a help line that states its default."""
    for formatter in (argparse.ArgumentDefaultsHelpFormatter, HelpFormatter):
        p = argparse.ArgumentParser(formatter_class=formatter)
        p.add_argument("--keep", type=int, default=None, help="keep K (default: all)")
        p.add_argument("--no-x", dest="x", action="store_false", help="no x")
        p.add_argument("--tuning", default="", help="speed levers")
        bad = malformed_defaults(p)
        if formatter is HelpFormatter:
            assert bad == []
        else:
            assert len(bad) == 3 and "(default: all) (default: None)" in bad[0], bad


def _normal(args) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()
            if k not in INTERNAL}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_print_config_nests_by_group_and_reads_back_the_same(name, tmp_path, capsys):
    needed, extra = COMMANDS[name]
    argv = [name, *needed, *extra]
    assert main(argv + ["--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) <= set(GROUPS) and all(isinstance(v, dict) for v in printed.values())
    sub = _subs()[name]
    for key, inner in printed.items():  # each key printed in a group is an option of that group
        group = next(g for g in sub._action_groups if g.title == key)
        assert set(inner) <= {a.dest for a in group._group_actions}, (key, inner)
    path = tmp_path / "printed.yaml"
    path.write_text(json.dumps(printed))
    parser = build_parser()
    want = _normal(apply_config(parser, argv))
    got = _normal(apply_config(build_parser(), [name, *needed, "--config", str(path)]))
    assert got == want
    # and the extras changed something: the round trip carried values, not only defaults
    assert got != _normal(apply_config(build_parser(), [name, *needed]))


def test_nested_and_flat_keys_mean_the_same(tmp_path, capsys):
    (tmp_path / "n.yaml").write_text("train: {mode: train, steps: 3}\nmodel:\n  model: tiny\n"
                                     "  dtype: bfloat16\nloss: {loss: nll}\nmax-tokens: 99\n")
    (tmp_path / "f.toml").write_text('mode = "train"\nsteps = 3\nmodel = "tiny"\n'
                                     'dtype = "bfloat16"\nloss = "nll"\nmax_tokens = 99\n')
    got = []
    for f in ("n.yaml", "f.toml"):
        assert main(["replay", "e.arrow", "--config", str(tmp_path / f), "--print-config"]) == 0
        got.append(json.loads(capsys.readouterr().out))
    assert got[0] == got[1]
    assert (got[0]["train"]["steps"], got[0]["model"]["dtype"], got[0]["layout"]["max_tokens"]) \
        == (3, "bfloat16", 99)


@pytest.mark.parametrize("text,needle", [
    ("model: {lr: 1.0}\n", "model.lr is not an option of treeflow replay's model group; lr is in "
                           "the train group"),
    ("steps: 2\ntrain: {steps: 3}\n", "steps and train.steps set the same option; keep one"),
    ("train: 3\n", "train = 3; train is a group of options: give a mapping"),
    ("data: {window: 3}\n", "'data.window' is now 'data.episodes_per_step'"),
    ("batch_episodes: 3\n", "'batch_episodes' is now 'episodes_per_step'"),
    ("ranks: 2\n", "'ranks' is now 'num_ranks'"),
    ("sampling: {seed: 1}\n", "sampling is no option group of treeflow replay; its groups are "
                             "data, model, layout, parallel, train, loss, checkpoint, logger, "
                             "output"),
    ("logger: [wandb, [x]]\n", "--logger takes one value"),
    ("turns: 3\n", "'turns' is not an option of treeflow replay"),
])
def test_bad_nesting_is_one_line(tmp_path, capsys, text, needle):
    (tmp_path / "bad.yaml").write_text(text)
    assert main(["replay", "e.arrow", "--mode", "train", "--episodes-per-step", "2",
                 "--config", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("old,new", [("--window", "--episodes-per-step"),
                                     ("--batch-episodes", "--episodes-per-step"),
                                     ("--ranks", "--num-ranks")])
@pytest.mark.parametrize("command", ["replay", "stream", "inspect", "plan"])
def test_removed_flag_fails_in_one_line_naming_the_new_one(capsys, command, old, new):
    if new not in _subs()[command].format_help():
        pytest.skip(f"treeflow {command} has no {new}")
    argv = [command] + (["e.arrow"] if command in ("replay", "inspect", "plan") else
                        ["--from", "e.arrow"]) + [old, "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {old} is now {new} (the old name was accepted for one release)\n"


def test_rollout_turns_from_a_config_file(tmp_path, capsys):
    """A two-value option (and a repeatable one) read from a file as a list."""
    (tmp_path / "r.yaml").write_text("sampling: {turns: [4, 6]}\nqueue: {queue: q}\n")
    assert main(["rollout", "--config", str(tmp_path / "r.yaml"), "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"]["turns"] == [4, 6]
    (tmp_path / "r.yaml").write_text("sampling: {turns: [4]}\n")
    assert main(["rollout", "--config", str(tmp_path / "r.yaml")]) == 2
    assert "--turns takes 2 values" in capsys.readouterr().err
