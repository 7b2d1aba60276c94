"""The training progress bar moves by bins within a step (a long step is not a frozen bar)."""

import io
import json
from contextlib import contextmanager

from rich.console import Console

import treeflow._display as display
from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes


def test_bar_shows_bins_of_the_step_in_progress(monkeypatch):
    out = io.StringIO()

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stderr", Tty())
    monkeypatch.setattr(display, "console",
                        lambda stderr=False: Console(file=out, force_terminal=True, width=150))
    with display.progress("train", 4) as advance:
        advance(1, metrics={"step": 1, "loss": 0.2468})  # the last step's loss, as verl's
        advance.bins(2, 7)  # the last render (before the transient bar is cleared) shows it
    assert "bins 2/7" in out.getvalue() and "loss 0.2468" in out.getvalue()
    with display.progress("train", 4, quiet=True) as advance:
        advance.bins(1, 2)  # quiet: nothing at all


def test_fit_reports_every_bin_of_every_step(tmp_path, monkeypatch, capsys):
    path = tmp_path / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=8,
                                  user_tokens=(2, 3), completion_tokens=(2, 3),
                                  tool_tokens=(2, 3), seed=5), path)
    events = []

    @contextmanager
    def recorder(description, total, quiet=False, **kw):
        if quiet:
            yield display._silent
            return

        def advance(n, **kw):
            events.append("step")

        advance.bins = lambda done, total: events.append((done, total))
        yield advance

    monkeypatch.setattr(display, "progress", recorder)
    args = ["replay", str(path), "--mode", "train", "--episodes-per-step", "2", "--steps", "2",
            "--loss", "nll", "--max-tokens", "24", "--metrics", str(tmp_path / "m.jsonl")]
    assert main(args) == 0
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    want = []
    for row in rows:
        assert row["bins"] > 1  # small bins: a step of several
        want += [(d, row["bins"]) for d in range(1, row["bins"] + 1)] + ["step"]
    assert events == want
    events.clear()
    (tmp_path / "m.jsonl").unlink()
    assert main(args + ["--json"]) == 0 and events == []  # --json (and --quiet): silent
    capsys.readouterr()
