"""fit_files / fit_summary / StepStages / logprobs_pipeline: the library calls `treeflow replay`
runs, against a hand-built pipeline and Trainer steps (not through the CLI)."""

import pytest

from treeflow.engines import LocalEngine
from treeflow.pipeline import Files
from treeflow.tools import synth_episodes, write_episodes
from treeflow.pipeline.rank_plan import StepStages, rank_stages
from treeflow.programs.replay import logprobs_pipeline
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Reduce, Shard
from treeflow.train.fit_files import fit_files, fit_summary


def _stages(**kw):
    return StepStages(forward=Forward(model="tiny"), reduce=Reduce(
        loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2)), max_tokens=256, **kw)


def test_step_stages_are_rank_stages_between_before_and_reduce():
    s = _stages(layout="chain")
    for world, rank in ((1, 0), (2, 1)):
        pipe = s.pipeline(world, rank)
        got = pipe.stages
        want = rank_stages(layout="chain", scope=None, share_rules="default", max_tokens=256,
                           num_ranks=world)
        assert got[:-2] == want and got[-2:] == (s.forward, s.reduce)
        binding = pipe.plan.binding  # the rank is the plan's, never a stage's
        assert (None if binding is None else (binding.ranks, binding.rank)) == \
            (None if world == 1 else (world, rank))


def test_logprobs_pipeline_budget_and_shard():
    pipe = logprobs_pipeline(Forward(model="tiny"), max_tokens=300)
    frag = next(x for x in pipe.stages if isinstance(x, Fragment))
    shard = next(x for x in pipe.stages if isinstance(x, Shard))
    assert frag.max_tokens == 300 and shard.cost is not None
    # the ranks are the engine's: an unbound plan is bound to its dp ranks, Shard dealing bins
    bound = LocalEngine(ranks=3).bind(pipe.plan)
    assert (bound.binding.ranks, bound.binding.rank, bound.binding.shares) == (3, None, False)
    assert LocalEngine().bind(pipe.plan) is pipe.plan


def test_fit_files_trains_the_steps_asked_and_summarises(tmp_path):
    eps = synth_episodes(episodes=8, group_size=2, turns=(1, 2), system_tokens=8,
                         user_tokens=(2, 4), completion_tokens=(2, 4), tool_tokens=(2, 4), seed=3)
    write_episodes(eps, tmp_path / "e.arrow")
    files = Files(paths=(str(tmp_path / "e.arrow"),), episodes_per_step=6)
    report = fit_files(_stages(), files, steps=3)
    # 8 episodes, windows of 6, cycled: 3 steps need a second pass
    assert [r["step"] for r in report["rows"]] == [1, 2, 3] and report["ranks"] == 1
    assert sum(r["episodes"] for r in report["rows"]) == 6 + 2 + 6
    out = fit_summary(report, tuning="plain")
    assert list(out)[:7] == ["steps", "last", "compile_seconds", "steady_seconds_per_step",
                             "recompiles", "kernel_builds", "tuning"]
    assert out["steps"] == 3 and out["last"]["train/loss"] == report["rows"][-1]["loss"]
    assert out["process_seconds"] > 0 and out["peak_rss_mib"] > 0


if __name__ == "__main__":
    pytest.main([__file__])
