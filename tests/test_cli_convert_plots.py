"""README's path for a user with chat rollouts: convert, inspect --plot, replay; plus TensorBoard."""

import json
import os

import pytest

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes
from treeflow.schemas import read_episodes

DATA = os.path.join(os.path.dirname(__file__), "data")
PNG = b"\x89PNG\r\n\x1a\n"


def _png_size(path):
    from matplotlib.image import imread

    return imread(path).shape


def test_convert_inspect_plot_replay(tmp_path, capsys):
    ep = str(tmp_path / "ep.arrow")
    assert main(["convert", os.path.join(DATA, "vllm_sglang.jsonl"), "-o", ep, "--format", "openai",
                 "--episode-id-field", "id", "--group-id-field", "meta.group", "--reward-field",
                 "reward", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # stdout holds exactly one JSON object
    assert (report["episodes"], report["calls"], report["exact_tokens"]) == (2, 4, 26)
    assert [r["group_id"] for r in read_episodes(ep).to_pylist()] == ["g0", "g0"]
    plots = str(tmp_path / "plots")
    assert main(["inspect", ep, "--plot", plots, "--max-tokens", "16", "--num-ranks", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(os.path.basename(p) for p in out["plots"]) == ["bins.png", "call_growth.png",
                                                                 "savings.png"]
    for p in out["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == PNG
        h, w = _png_size(p)[:2]
        assert h >= 300 and w >= 600
    lp = str(tmp_path / "lp.arrow")
    assert main(["replay", ep, "--model", "tiny", "-o", lp, "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    import pyarrow as pa

    res = pa.ipc.open_file(lp).read_all().to_pylist()
    assert [len(x) for x in res[0]["logprobs"]] == [2, 2]  # two calls, two sampled tokens each


def test_inspect_plot_on_synthetic_data(tmp_path, capsys):
    f = str(tmp_path / "ep.parquet")
    write_episodes(synth_episodes(episodes=16, group_size=4, turns=(2, 5), seed=3), f)
    plots = str(tmp_path / "p")
    assert main(["inspect", f, "--plot", plots, "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    # no bins without a budget; each picture with the numbers it shows
    assert sorted(os.listdir(plots)) == ["call_growth.json", "call_growth.png", "savings.json",
                                         "savings.png"]
    assert all(os.path.getsize(os.path.join(plots, p)) > 10_000 for p in os.listdir(plots)
               if p.endswith(".png"))
    assert len(json.load(open(os.path.join(plots, "savings.json")))["data"]["saving_tree"]) == 16


def test_convert_chat_warns_and_counts(tmp_path, capsys, tokenizer_dir):
    ep = str(tmp_path / "ep.arrow")
    assert main(["convert", os.path.join(DATA, "chat.jsonl"), "-o", ep, "--format", "chat",
                 "--tokenizer", tokenizer_dir, "--group-id-field", "group_id"]) == 0
    captured = capsys.readouterr()
    assert "not guaranteed" in captured.err and "1 of 2 calls are not a prefix" in captured.err
    assert "non_prefix_calls" in captured.out


def test_convert_errors_exit_2_and_write_nothing(tmp_path, capsys):
    ep = str(tmp_path / "ep.arrow")
    assert main(["convert", os.path.join(DATA, "vllm_sglang.jsonl"), "-o", ep,
                 "--format", "openai"]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "no field 'episode_id'" in err and "--episode-id-field" in err
    assert not os.path.exists(ep)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    assert main(["convert", os.path.join(DATA, "chat.jsonl"), "-o", ep, "--format", "chat"]) == 2
    assert "--tokenizer DIR" in capsys.readouterr().err


def test_convert_nemo_rl(tmp_path, capsys):
    ep = str(tmp_path / "ep.parquet")
    assert main(["convert", os.path.join(DATA, "nemo_rl.jsonl"), "-o", ep, "--format", "nemo-rl",
                 "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    rows = read_episodes(ep).to_pylist()
    assert [r["reward"] for r in rows] == [1.0, 0.0]
    assert rows[1]["calls"][0]["routed_experts"] == [[0, 1], [2, 3], [4, 5], [-1, -1]]


@pytest.fixture
def tokenizer_dir(tmp_path_factory):
    from tests.io.conftest import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_train_logs_to_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    f = str(tmp_path / "ep.arrow")
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6),
                                  seed=5), f)
    tb, metrics = str(tmp_path / "tb"), str(tmp_path / "m.jsonl")
    assert main(["replay", f, "--mode", "train", "--episodes-per-step", "2", "--steps", "3",
                 "--max-tokens", "256", "--tensorboard", tb, "--metrics", metrics, "--json"]) == 0
    json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in open(metrics)]
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/episodes_consumed"} <= set(tags)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [e.value for e in acc.Scalars("train/episodes_consumed")] == [2, 4, 6]


def test_nemo_rl_sample_mixed_routes_refused_by_file_and_episode_then_runs_apart(tmp_path,
                                                                                capsys):
    """tests/data/nemo_rl.jsonl: line 1 has no routes, line 2 routes on every call. A window
    holding both is refused by inspect, replay and training, naming the file and one episode
    of each kind (issue 48: the message named the unrouted episode as if it mixed routes);
    steps of one episode each run (routes are per window)."""
    ep = str(tmp_path / "nrl.arrow")
    assert main(["convert", os.path.join(DATA, "nemo_rl.jsonl"), "-o", ep, "--format",
                 "nemo-rl", "--quiet"]) == 0
    train = ["--mode", "train", "--loss", "nll", "--steps", "2", "--max-tokens", "64", "--quiet"]
    for argv in (["inspect", ep], ["replay", ep, "-o", str(tmp_path / "lp.arrow")],
                 ["replay", ep, *train, "--episodes-per-step", "2"]):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert f"error: {ep}: episode 'nemo_rl.jsonl:2' carries routed_experts and episode " \
               "'nemo_rl.jsonl:1' does not, in one window" in err, err
        assert "--episodes-per-step" in err
    for argv in (["inspect", ep, "--json"],
                 ["replay", ep, "-o", str(tmp_path / "lp1.arrow"), "--json"],
                 ["replay", ep, *train]):
        assert main([*argv, "--episodes-per-step", "1"]) == 0, capsys.readouterr().err
