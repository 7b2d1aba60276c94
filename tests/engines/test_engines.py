"""Engines are objects: a new one is a subclass in user code, run by the package unchanged.

`SerialEngine` below is written here as a user would write one, from the public Plan API only
(no prefetch thread, one window at a time); `replay_logprobs` (what `treeflow replay` runs)
takes it and must give the local engine's rows bit for bit, and the same counts.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from treeflow.engines import ENGINES, Engine, LocalEngine, RayEngine, engine_for
from treeflow.ops.train import Window
from treeflow.parallel import ParallelDims
from treeflow.pipeline import Files
from treeflow.tools import synth_episodes, write_episodes
from treeflow.pipeline.plan import WindowResult
from treeflow.programs.replay import logprobs_pipeline, replay_logprobs
from treeflow.pipeline.stats import bin_sums, episode_sums
from treeflow.stages import Forward


class SerialEngine(Engine):
    """Every window read, planned, run and finished before the next is read."""

    name = "serial"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.windows = 0

    def run(self, pipeline, source, *, trainer=None, steps=None):
        plan = pipeline.plan
        worker = plan.worker(device=self.device, trainer=trainer)
        worker.warm_up()
        it = iter(source)
        for step, episodes in enumerate(it):
            if steps is not None and step >= steps:
                return
            episodes = plan.episodes(episodes, step=step)
            bins = plan.prepare(episodes, step=step)
            position = it.get_state() if hasattr(it, "get_state") else None
            acc = worker.open(Window(step=step, episodes=episodes, position=position))
            acc.add(worker.prepare(bins))
            out = acc.finish()
            self.windows += 1
            yield WindowResult(step=step, episodes=episodes, output=out,
                               stats={**episode_sums(episodes), **bin_sums(bins), **acc.stats()},
                               position=position)


def _files(tmp_path):
    path = str(tmp_path / "e.arrow")
    write_episodes(synth_episodes(episodes=12, group_size=3, turns=(2, 3), system_tokens=8,
                                  user_tokens=(2, 4), completion_tokens=(2, 5),
                                  tool_tokens=(2, 3), vocab_size=256, seed=3), path)
    return Files(paths=(path,), episodes_per_step=6)


def test_a_users_engine_runs_replay_end_to_end(tmp_path):
    files = _files(tmp_path)
    pipe = logprobs_pipeline(Forward(model="tiny"), max_tokens=256)
    serial = SerialEngine()
    got = replay_logprobs(pipe, files, str(tmp_path / "serial.arrow"), engine=serial,
                          quiet=True)
    want = replay_logprobs(pipe, files, str(tmp_path / "local.arrow"), engine=LocalEngine(),
                           quiet=True)
    assert serial.windows == 2  # 12 episodes in windows of 6: the engine ran them itself
    a = pa.ipc.open_file(str(tmp_path / "serial.arrow")).read_all()
    b = pa.ipc.open_file(str(tmp_path / "local.arrow")).read_all()
    assert a.num_rows == 12 and a.equals(b)
    for key in ("episodes", "calls", "sampled_tokens", "bins", "executed_tokens"):
        assert got[key] == want[key] > 0, key


def test_names_resolve_once_and_objects_carry_their_options():
    assert set(ENGINES) == {"local", "ray"}
    ray = engine_for("ray", ranks=3, threads=2)
    assert isinstance(ray, RayEngine) and ray.owns_processes and ray.ranks == 3
    assert ray.dims == ParallelDims(dp=3) and ray.options == {"threads": 2}
    assert ray.with_options(plans=[1]).options == {"threads": 2, "plans": [1]}
    local = engine_for("local")
    assert isinstance(local, LocalEngine) and not local.owns_processes
    assert engine_for(local) is local
    with pytest.raises(ValueError, match=r"engine 'spark': choose one of \('local', 'ray'\)"):
        engine_for("spark")
    with pytest.raises(ValueError, match=r"built already: give \['ranks'\]"):
        engine_for(local, ranks=2)
    with pytest.raises(ValueError, match=r"engine 'local' takes no \['threads'\]"):
        engine_for("local", threads=2)
    with pytest.raises(ValueError, match=r"RayEngine takes no \['thread'\]"):
        RayEngine(thread=2)
    with pytest.raises(TypeError, match="give a name"):
        engine_for(3)
    # device and prefetch are the engine's, carried by every copy of it
    placed = ray.with_options(device="cuda:1", prefetch=3)
    assert (placed.device, placed.prefetch, placed.options, placed.dims) == \
        ("cuda:1", 3, {"threads": 2}, ParallelDims(dp=3))
    assert (ray.device, ray.prefetch) == ("cpu", 2)
    assert engine_for("local", device="cuda", prefetch=4).prefetch == 4
    with pytest.raises(ValueError, match=r"LocalEngine\(prefetch=0\) \(--prefetch\)"):
        LocalEngine(prefetch=0)


def test_idle_ranks_are_said_only_for_engines_that_start_them():
    """replay_logprobs says (log=) when the Ray engine's forward actors outnumber the bins."""
    said = RayEngine(ranks=2).idle_ranks_warning(bins=1)
    assert said.startswith("warning: --num-ranks 2: the run made 1 bin(s)")
    assert RayEngine(ranks=2).idle_ranks_warning(bins=2) is None
    assert LocalEngine(ranks=2).idle_ranks_warning(bins=1) is None


@pytest.mark.parametrize("dims, replicas, plans, coords", [
    (ParallelDims(), [0], [True], [(0, 0, 0)]),
    (ParallelDims(dp=2, cp=2), [0, 0, 1, 1], [True, False, True, False],
     [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]),
    (ParallelDims(dp=3, tp=2), [0, 0, 1, 1, 2, 2], [True, False] * 3,
     [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (2, 0, 0), (2, 0, 1)]),
    (ParallelDims(cp=3), [0, 0, 0], [True, False, False], [(0, 0, 0), (0, 1, 0), (0, 2, 0)]),
])
def test_rank_arithmetic(dims, replicas, plans, coords):
    assert dims.world == len(replicas)
    assert [dims.replica(r) for r in range(dims.world)] == replicas
    assert [dims.plans(r) for r in range(dims.world)] == plans
    assert [(c.dp, c.cp, c.tp) for c in map(dims.coords, range(dims.world))] == coords
    assert [dims.leads(r) for r in range(dims.world)] == [True] + [False] * (dims.world - 1)


def test_dims_refuse_what_cannot_run():
    with pytest.raises(ValueError, match=r"ParallelDims\(dp=0\): give an int >= 1"):
        ParallelDims(dp=0)
    with pytest.raises(ValueError, match="context and tensor parallelism together"):
        ParallelDims(cp=2, tp=2)
    with pytest.raises(ValueError, match="expert parallelism is not implemented"):
        ParallelDims(ep=2)
    with pytest.raises(ValueError, match="rank 4 of"):
        ParallelDims(dp=2, cp=2).coords(4)
