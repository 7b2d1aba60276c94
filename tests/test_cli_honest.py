"""The run says on stderr when it does something other than asked (--batch-episodes)."""

import pytest

from treeflow.cli import main
from treeflow.pipeline import synth_episodes, write_episodes


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
    assert main(["replay", data, "--mode", "train", "--loss", "nll", "--batch-episodes", batch,
                 "--steps", "2", "--max-tokens", "256", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"--batch-episodes {batch}: step 1 {said}" in err
    assert err.count("--batch-episodes") == 1  # once, not per step


def test_batch_episodes_as_asked_says_nothing(data, capsys):
    assert main(["replay", data, "--mode", "train", "--loss", "nll", "--batch-episodes", "4",
                 "--steps", "1", "--max-tokens", "256", "--quiet"]) == 0
    assert "--batch-episodes" not in capsys.readouterr().err
