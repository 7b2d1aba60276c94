"""Advantage from rewards (GRPO, RLOO) against hand formulas, in the pipeline and the CLI."""

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from treeflow.cli import main
from treeflow.pipeline import Files
from treeflow.tools import synth_episodes, write_episodes
from treeflow.stages import Advantage, group_advantages


def _hand_grpo(rewards, std=True, eps=1e-6):
    n = len(rewards)
    m = sum(rewards) / n
    s = math.sqrt(sum((r - m) ** 2 for r in rewards) / (n - 1))
    return [(r - m) / (s + eps) if std else r - m for r in rewards]


def _hand_rloo(rewards):
    n = len(rewards)
    return [r - (sum(rewards) - r) / (n - 1) for r in rewards]


GROUPS = ["a", "a", "a", "b", "b", "c", "c", "c", "c"]
REWARDS = [1.0, 0.0, 0.5, 2.0, -1.0, 0.0, 0.0, 1.0, 3.0]


def _by_group(fn):
    out = []
    for g in dict.fromkeys(GROUPS):
        out += fn([r for r, h in zip(REWARDS, GROUPS) if h == g])
    return out


@pytest.mark.parametrize("estimator,std,hand", [
    ("grpo", True, lambda r: _hand_grpo(r)),
    ("grpo", False, lambda r: _hand_grpo(r, std=False)),
    ("rloo", True, _hand_rloo),
])
def test_group_advantages_match_hand_formulas(estimator, std, hand):
    got = group_advantages(REWARDS, GROUPS, estimator=estimator, std_normalize=std)
    np.testing.assert_allclose(got, _by_group(hand), rtol=1e-6, atol=1e-6)


def test_equal_rewards_give_zero_and_refusals():
    np.testing.assert_array_equal(group_advantages([1.0, 1.0], ["g", "g"]), [0.0, 0.0])
    with pytest.raises(ValueError, match="group 'a': its episodes are not contiguous"):
        group_advantages([1, 2, 3], ["a", "b", "a"])
    with pytest.raises(ValueError, match="group 'b' has one episode"):
        group_advantages([1, 2, 3], ["a", "a", "b"])
    with pytest.raises(ValueError, match="no group_id"):
        group_advantages([1, 2], ["a", None])
    with pytest.raises(ValueError, match="estimator"):
        Advantage(estimator="ppo")


def _episodes(n=8, group_size=4):
    t = synth_episodes(episodes=n, group_size=group_size, turns=(2, 3), system_tokens=12,
                       user_tokens=(3, 5), completion_tokens=(3, 5), tool_tokens=(3, 5), seed=3)
    return t


def test_stage_fills_advantage_and_refuses_missing_reward():
    t = _episodes()
    t = t.set_column(t.schema.get_field_index("advantage"), "advantage",
                     pa.nulls(t.num_rows, pa.float32()))
    out = Advantage(estimator="rloo")(t)
    want = group_advantages(t.column("reward").to_numpy(), t.column("group_id").to_pylist(),
                            estimator="rloo")
    np.testing.assert_array_equal(out.column("advantage").to_numpy(), want)
    no_reward = t.set_column(t.schema.get_field_index("reward"), "reward",
                             pa.nulls(t.num_rows, pa.float32()))
    with pytest.raises(ValueError, match="field 'reward' is missing"):
        Advantage()(no_reward)


def test_stored_advantage_replaced_with_a_warning():
    t = _episodes()
    with pytest.warns(UserWarning, match="training on the one computed from 'reward'"):
        out = Advantage()(t)
    assert out.column("advantage").to_pylist() != t.column("advantage").to_pylist()


def test_files_gather_interleaved_groups_and_refuse_an_ungrouped_episode(tmp_path):
    t = _episodes(8, 4)
    order = [0, 1, 4, 5, 2, 3, 6, 7]  # group 0, group 1, group 0 again ...
    path = tmp_path / "split.arrow"
    write_episodes(t.take(order), path)
    # whole groups, in the order they complete (tests/test_steps.py holds the rule)
    wins = list(Files(paths=(str(path),), episodes_per_step=2))
    assert [w.column("group_id").to_pylist() for w in wins] == [["g0"] * 4, ["g1"] * 4]
    t = t.set_column(t.schema.get_field_index("group_id"), "group_id",
                     pa.array(["g0"] * 4 + [None] * 4, pa.string()))
    write_episodes(t, tmp_path / "loose.arrow")
    files = Files(paths=(str(tmp_path / "loose.arrow"),), episodes_per_step=2,
                  require_groups="--advantage grpo")
    for read in (list, Files.spans):
        with pytest.raises(ValueError, match=r"episode 'g1-e0' \(.*loose.arrow row 4\) has no "
                                             "group_id, and --advantage grpo"):
            read(files)


def _rollouts(path, groups=2, group_size=4):
    """README's line format: id, group, reward, calls with token ids and logprobs."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for g in range(groups):
            prompt = [int(x) for x in rng.integers(1, 1000, 12)]
            for i in range(group_size):
                done = [int(x) for x in rng.integers(1, 1000, 4)]
                calls = [{"prompt_token_ids": prompt, "choices": [{"token_ids": done, "logprobs": {
                    "content": [{"token": f"token_id:{t}", "logprob": -7.0} for t in done]}}]}]
                f.write(json.dumps({"id": f"ep-{g}-{i}", "group": f"prompt-{g}",
                                    "reward": float(i % 2), "calls": calls}) + "\n")


def test_readme_convert_flow_trains_with_grpo(tmp_path, capsys):
    """convert --reward-field reward --group-id-field group, then --mode train --loss pg
    --advantage grpo: the advantage the step trains on is the hand formula's (seen through
    the loss: pg loss at ratio 1 is -mean(advantage) over tokens, token-mean)."""
    _rollouts(tmp_path / "r.jsonl")
    ep = str(tmp_path / "e.arrow")
    assert main(["convert", str(tmp_path / "r.jsonl"), "-o", ep, "--format", "openai",
                 "--episode-id-field", "id", "--group-id-field", "group",
                 "--reward-field", "reward", "--quiet"]) == 0
    capsys.readouterr()
    base = ["replay", ep, "--mode", "train", "--loss", "pg", "--episodes-per-step", "8",
            "--steps", "1", "--json"]
    assert main(base) == 2
    assert "'advantage' is missing" in capsys.readouterr().err
    assert main([*base, "--advantage", "grpo"]) == 0
    captured = capsys.readouterr()
    assert "ratio_mean" in captured.err and "far from 1" in captured.err  # -7.0 is not tiny's
    last = json.loads(captured.out)["last"]
    # every episode has 4 loss tokens: the token mean of -A*ratio (unclipped side) is a sum
    # we can't see directly, but with equal rewards per parity the group means are 0.5 and the
    # advantages +-0.866: their token mean is 0, so the loss is small next to the advantages
    assert abs(last["loss"]) < 0.5
    assert main([*base, "--advantage", "rloo", "--no-std-normalize"]) == 2
    assert "grpo options" in capsys.readouterr().err


def test_advantage_reaches_the_step(tmp_path):
    """The step's loss with Advantage(grpo) equals the loss on a file whose stored advantage is
    the hand formula's (same model, same episodes)."""
    from treeflow.pipeline import Pipeline
    from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce
    from treeflow.train import Trainer

    t = _episodes(8, 4)
    t = t.set_column(t.schema.get_field_index("advantage"), "advantage",
                     pa.nulls(t.num_rows, pa.float32()))
    hand = []
    for g in dict.fromkeys(t.column("group_id").to_pylist()):
        hand += _hand_grpo([r for r, h in zip(t.column("reward").to_pylist(),
                                              t.column("group_id").to_pylist()) if h == g])
    stored = t.set_column(t.schema.get_field_index("advantage"), "advantage",
                          pa.array(hand, pa.float32()))

    def loss(table, *pre):
        fwd = Forward(model="tiny")
        red = Reduce(loss=Loss(kind="pg"), schedule=EpisodeSchedule(lr=0.0))
        trainer = Trainer(fwd, red)
        rec = next(iter(Pipeline(*pre, Pack(), Fragment(max_tokens=4096), fwd, red).run(
            [table], trainer=trainer)))
        return rec.output.column("loss")[0].as_py()

    a, b = loss(t, Advantage()), loss(stored)
    assert a == pytest.approx(b, rel=1e-5, abs=1e-7) and a != 0.0
    with pytest.raises(TypeError, match="Pack produces layout/1 rows but Advantage takes"):
        Pipeline(Pack(), Advantage(), Fragment(max_tokens=4096))


def test_stream_train_computes_advantages(tmp_path, capsys):
    """stream --mode train --advantage grpo on queue steps of whole groups (converted episodes
    without an advantage: refused without the flag, trained with it)."""
    _rollouts(tmp_path / "r.jsonl")
    ep = str(tmp_path / "e.arrow")
    assert main(["convert", str(tmp_path / "r.jsonl"), "-o", ep, "--format", "openai",
                 "--episode-id-field", "id", "--group-id-field", "group",
                 "--reward-field", "reward", "--quiet"]) == 0
    base = ["stream", "--from", ep, "--mode", "train", "--loss", "pg", "--episodes-per-step", "4",
            "--json"]
    assert main(base) == 2
    assert "'advantage' is missing" in capsys.readouterr().err
    assert main([*base, "--advantage", "rloo"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["episodes"] == 8
