"""The one step rule (treeflow/steps.py): files, the queue and the Ray driver's spans cut the
same steps of whole groups, in order of completion, however the groups interleave."""

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from treeflow.cli import main
from treeflow.pipeline import Files
from treeflow.tools import synth_episodes, write_episodes
from treeflow.steps import assemble


def _reference_steps(group_ids, B):
    """The rule written out independently: each group (a None: its own row) ends at its last
    row; groups sorted by that row; greedy whole groups until >= B episodes."""
    last, rows = {}, {}
    for i, g in enumerate(group_ids):
        key = ("row", i) if g is None else ("g", g)
        last[key] = i
        rows.setdefault(key, []).append(i)
    order = sorted(rows, key=lambda k: last[k])
    steps, cur = [], []
    for k in order:
        cur += rows[k]
        if len(cur) >= B:
            steps.append(cur)
            cur = []
    return steps + ([cur] if cur else [])


def _interleaved(n_groups, size, spread, seed):
    """Group ids of `n_groups` groups of `size`, each episode placed at its group's index
    plus a random offset in [0, spread): groups overlap and finish out of first-row order."""
    rng = np.random.default_rng(seed)
    key = np.repeat(np.arange(n_groups, dtype=float), size) + rng.uniform(0, spread,
                                                                          n_groups * size)
    return np.argsort(key, kind="stable")  # rows of the sorted episodes, in the new order


@pytest.mark.parametrize("seed", range(6))
def test_assemble_equals_the_rule_written_out_for_any_batching(seed):
    rng = np.random.default_rng(100 + seed)
    order = _interleaved(9, int(rng.integers(1, 5)), float(rng.uniform(1, 4)), seed)
    size = len(order) // 9
    gids = [f"g{i // size}" for i in order]
    for i in rng.choice(len(gids), 2, replace=False):   # two ungrouped episodes
        gids[i] = None
    t = pa.table({"group_id": pa.array(gids, pa.string()), "row": np.arange(len(gids))})
    B = int(rng.integers(1, 8))
    want = _reference_steps(gids, B)
    for batch in (1, 2, 5, len(gids)):
        got = [w.column("row").to_pylist() for w in
               assemble((t.slice(a, batch) for a in range(0, len(gids), batch)), B, window=64)]
        assert got == want, (batch, B)


def test_a_sorted_file_is_cut_without_copying_its_rows():
    """Groups in file order: each step is a slice of the batches read (the same buffers), not a
    copy, and neither are the rows held back; copying every held row at every cut made a
    replay's assembly of 512 routed episodes take 10 s (steps.py `_rows_of`). Interleaved
    groups still give the rule's rows (the test above), through a copy."""
    gids = [f"g{i // 4}" for i in range(64)]
    t = pa.table({"group_id": pa.array(gids, pa.string()),
                  "payload": pa.array([[float(i)] * 3 for i in range(64)])})
    base = t.column("payload").chunks[0].values.buffers()[1].address
    steps = list(assemble((t.slice(a, 32) for a in range(0, 64, 32)), 8, window=16))
    assert [w.num_rows for w in steps] == [8] * 8
    for k, w in enumerate(steps):
        assert w.column("group_id").to_pylist() == gids[8 * k:8 * k + 8]
        for chunk in w.column("payload").chunks:  # the first step's rows at the first row
            addr = chunk.values.buffers()[1].address + 8 * chunk.values.offset
            assert base <= addr < base + 64 * 3 * 8, k


def test_assemble_refuses_a_group_beyond_the_window_and_an_ungrouped_episode():
    t = pa.table({"group_id": ["a", "b", "b", "c", "a"], "episode_id": list("vwxyz")})
    assert len(list(assemble([t], 2, window=5))) == 2
    with pytest.raises(ValueError, match=r"group 'a': its episodes lie 5 episodes apart .*"
                                         r"--group-window"):
        list(assemble([t], 2, window=4))
    t = pa.table({"group_id": ["a", None, "a"], "episode_id": list("xyz")})
    with pytest.raises(ValueError, match=r"episode 'y' \(row 1 of the input\) has no group_id.*"
                                         "--advantage grpo"):
        list(assemble([t], 2, require_groups="--advantage grpo"))


# ---------------------------------------------------------------- files, spans, the queue

def _write_interleaved(tmp_path, name, episodes, order, split=None):
    """The episodes in `order`, as one file or two (cut at row `split`, inside a group)."""
    t = episodes.take(pa.array(order))
    if split is None:
        write_episodes(t, tmp_path / f"{name}.arrow")
        return [str(tmp_path / f"{name}.arrow")]
    paths = [str(tmp_path / f"{name}-{k}.arrow") for k in (0, 1)]
    write_episodes(t.slice(0, split), paths[0])
    write_episodes(t.slice(split), paths[1])
    return paths


@pytest.fixture(scope="module")
def episodes():
    t = synth_episodes(episodes=24, group_size=3, turns=(1, 2), system_tokens=12,
                       user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5), seed=5)
    return t.set_column(t.schema.get_field_index("advantage"), "advantage",
                        pa.nulls(t.num_rows, pa.float32()))


ORDER = _interleaved(8, 3, 2.5, seed=0)


def test_order_is_interleaved_and_completion_differs_from_first_episode():
    gids = [i // 3 for i in ORDER]
    firsts = list(dict.fromkeys(gids))
    lasts = sorted(set(gids), key=lambda g: max(i for i, h in enumerate(gids) if h == g))
    assert firsts != lasts          # the tests below can tell the two orders apart
    split = 11
    assert gids[split - 1] in gids[split:]   # the two-file case cuts a group


def _queue_steps(paths, B, chunk):
    from treeflow.pipeline.queue_source import QueueSource, put_files
    from treeflow.tq import open_queue

    q = open_queue(capacity=1024)   # in this process only
    try:
        put_files(q, paths, chunk=chunk)
        reader = QueueSource(episodes_per_step=B, ack="auto", idle_timeout=30).open(q)
        try:
            return [w.column("episode_id").to_pylist() for w in reader]
        finally:
            reader.close()
    finally:
        q.shutdown()


@pytest.mark.parametrize("split", [None, 11])
def test_files_spans_and_the_queue_cut_the_same_steps(episodes, tmp_path, split):
    from treeflow.pipeline.ray_maps import read_window

    paths = _write_interleaved(tmp_path, "i", episodes, ORDER, split)
    ids = episodes.column("episode_id").to_pylist()
    gids = [ids[i].split("-")[0] for i in ORDER]
    want = [[ids[ORDER[r]] for r in step] for step in _reference_steps(gids, 5)]
    files = Files(paths=tuple(paths), episodes_per_step=5)
    assert [w.column("episode_id").to_pylist() for w in files] == want
    spans = files.spans()
    assert [read_window(p, None).column("episode_id").to_pylist() for p in spans] == want
    assert len(spans[0]) > 1                 # an interleaved window is several pieces
    for chunk in (2, 7):                     # how the producer chunks never matters
        assert _queue_steps(paths, 5, chunk) == want


# ---------------------------------------------------------------- the CLI, bit for bit

TRAIN = ["--mode", "train", "--layout", "tree", "--max-tokens", "512", "--episodes-per-step", "5",
         "--loss", "nll", "--lr", "1e-3", "--json"]
SAME = ("step", "episodes", "bins", "executed_tokens", "loss", "grad_norm")


def _train(tmp_path, name, cmd, capsys):
    from safetensors.torch import load_file

    assert main(cmd + ["--save", str(tmp_path / name), "--metrics",
                       str(tmp_path / f"{name}.jsonl")]) == 0, capsys.readouterr().err
    capsys.readouterr()
    rows = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
    return rows, load_file(tmp_path / name / "step-000003" / "model.safetensors")


def _bit_equal(a, b):
    import torch

    (rows_a, w_a), (rows_b, w_b) = a, b
    assert len(rows_a) == len(rows_b) == 3
    for ra, rb in zip(rows_a, rows_b):
        assert {k: ra[k] for k in SAME} == {k: rb[k] for k in SAME}
    assert w_a.keys() == w_b.keys()
    for name in w_a:
        assert torch.equal(w_a[name], w_b[name]), name


@pytest.mark.parametrize("split", [None, 11])
def test_stream_from_trains_the_steps_replay_trains(episodes, tmp_path, capsys, split):
    paths = _write_interleaved(tmp_path, "i", episodes, ORDER, split)
    replay = _train(tmp_path, "r", ["replay", *paths, *TRAIN, "--steps", "3"], capsys)
    assert [r["episodes"] for r in replay[0]] == [6, 6, 6]
    stream = _train(tmp_path, "s", ["stream", "--from", *paths, "--chunk", "2", *TRAIN,
                                    "--steps", "3"], capsys)
    _bit_equal(replay, stream)
    # a group spread beyond the look-ahead is refused by both, by name, with the file
    for cmd in (["replay", *paths], ["stream", "--from", *paths]):
        assert main(cmd + [*TRAIN, "--steps", "3", "--group-window", "3"]) == 2
        err = capsys.readouterr().err
        assert "its episodes lie" in err and "--group-window" in err and paths[0] in err, err


def _hand_grpo(rewards, eps=1e-6):
    n, m = len(rewards), sum(rewards) / len(rewards)
    s = math.sqrt(sum((r - m) ** 2 for r in rewards) / (n - 1))
    return [(r - m) / (s + eps) for r in rewards]


def test_grpo_on_interleaved_groups_equals_the_sorted_file_and_the_hand_formula(
        episodes, tmp_path, capsys):
    grpo = ["--loss", "pg", "--advantage", "grpo"]
    opts = [o for o in TRAIN if o not in ("--loss", "nll")] + ["--steps", "3"]
    inter = _write_interleaved(tmp_path, "i", episodes, ORDER)
    # sorted: a stable sort by group, the groups in the order they complete (each group's
    # episodes keep their order in the file, as `sort` by group id keeps them)
    gids = [i // 3 for i in ORDER]
    done = sorted(set(gids), key=lambda g: max(i for i, h in enumerate(gids) if h == g))
    srt = _write_interleaved(tmp_path, "s", episodes,
                             [int(i) for g in done for i in ORDER if i // 3 == g])
    a = _train(tmp_path, "a", ["replay", *inter, *opts, *grpo], capsys)
    b = _train(tmp_path, "b", ["replay", *srt, *opts, *grpo], capsys)
    c = _train(tmp_path, "c", ["stream", "--from", *inter, "--chunk", "2", *opts, *grpo], capsys)
    _bit_equal(a, b)
    _bit_equal(a, c)
    # the advantages against the hand formula: the same run on stored hand-computed ones
    rewards = episodes.column("reward").to_pylist()
    hand = [v for g in range(8) for v in _hand_grpo(rewards[3 * g:3 * g + 3])]
    stored = episodes.set_column(episodes.schema.get_field_index("advantage"), "advantage",
                                 pa.array(hand, pa.float32()))
    ref = _write_interleaved(tmp_path, "h", stored, ORDER)
    h = _train(tmp_path, "h", ["replay", *ref, *opts, "--loss", "pg", "--advantage", "none"],
               capsys)
    for ra, rh in zip(a[0], h[0], strict=True):
        assert ra["loss"] == pytest.approx(rh["loss"], rel=1e-5, abs=1e-7) and ra["loss"] != 0
