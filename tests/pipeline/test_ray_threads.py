"""The Ray engine's rank actors run as many torch threads as the Ray CPUs they reserve.

The stage operators run in their own processes beside the forward (the local
engine runs them in line); a rank actor whose OpenMP threads fill every core
has one taken off its core by a stage operator and the others spin at the
next barrier (pipeline/ray.py `rank_threads`). So the actor's threads are
the CPUs free for it beside one whole CPU and one core per stage operator, it
reserves them (Ray states them as the actor's OMP_NUM_THREADS), and the run
reports them as the local engine's does. Below 8 free CPUs a rank keeps the
local engine's threads (one core of two left to the stage operators cost more).
"""

import os

import pyarrow as pa
import pytest
import torch

from treeflow.pipeline import Files, Pipeline
from treeflow.tools import synth_episodes, write_episodes
from treeflow.pipeline.ray import RayRanks, rank_threads
from treeflow.stages import Forward, Fragment, Pack, Reassemble, Shard

from tests.ray_helpers import wait_for_free_cpus


def test_rank_threads_are_the_cpus_free_beside_the_read_and_the_stage_operators():
    def rt(free, share, procs, cores, **kw):
        return rank_threads(free, share, procs, cores=cores, cpu_count=kw.pop("cpus", cores), **kw)

    # 2 cores, one rank: the local engine's 2 threads (1 was 63% slower), as far as free
    threads, reserve, why, _ = rt(2, 1.0, 1, 2)
    assert (threads, reserve) == (2, 1.0) and "under 8 free CPUs" in why, why
    # 16 free: 14 threads, 14 CPUs reserved (was 16 threads on a reservation of 1)
    threads, reserve, why, warning = rt(16, 1.0, 1, 16)
    assert (threads, reserve, warning) == (14, 14.0, None)
    assert why.startswith("RayEngine: the rank actor's 14 reserved Ray CPUs (16 free"), why
    # beside 3 stage operators, each a process on a core of its own while it runs: 12 (at 14
    # the rank's OpenMP threads spun against them: 13% slower than the local engine at 14)
    threads, reserve, why, _ = rt(16, 1.0, 1, 16, stages=3)
    assert (threads, reserve) == (12, 12.0) and "3 for the stage operators' processes" in why
    assert rt(16, 1.0, 2, 16, stages=3)[:2] == (6, 6.0)  # shared out over two ranks
    assert rt(16, 1.0, 1, 16, stages=3, given=14)[3] is not None  # more than is free: said
    # never more than the local engine's threads (9 logical CPUs on 2 cores), shared out
    assert rt(9, 1.0, 1, 2)[:2] == (2, 2.0)
    assert rt(9, 1.0, 2, 2, cpus=2)[:2] == (1, 1.0)
    assert rt(4, 1.0, 1, 2)[:2] == (2, 2.0)  # the test cluster's 4 logical CPUs
    # nothing free for a rank: one thread on the stage operators' share, as before
    assert rt(4, 1.0, 3, 2)[:2] == (1, 1.0)
    # given: taken, reserved as far as free, and said on stderr when it oversubscribes
    assert rt(16, 1.0, 1, 16, given=8)[:2] == (8, 8.0)
    threads, reserve, why, warning = rt(2, 1.0, 1, 2, given=4)
    assert (threads, reserve) == (4, 1.0) and why.startswith("threads=4 given")
    assert warning is not None and "threads=4" in warning
    # CUDA ranks reserve no CPU and share this process's threads out
    assert rt(16, 1.0, 2, 16, cpus=16, cuda=True)[:2] == (8, 0.0)


def one_rank_pipe() -> Pipeline:
    return Pipeline(Pack(), Fragment(max_tokens=96), Shard(), Forward(), Reassemble())


def rule(free: float, engine: RayRanks, pipe: Pipeline) -> tuple:
    """What `rank_threads` gives one rank on `free` CPUs and this process's torch threads."""
    return rank_threads(free, engine.map_cpus, 1, cores=torch.get_num_threads(),
                        cpu_count=os.cpu_count() or 1, stages=len(pipe.plan.maps))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray_threads") / "e.arrow"
    write_episodes(synth_episodes(episodes=8, group_size=2, turns=(2, 3), system_tokens=8,
                                  user_tokens=(3, 6), completion_tokens=(3, 8),
                                  tool_tokens=(3, 6), seed=5), path)
    return Files(paths=(str(path),), episodes_per_step=4)


@pytest.fixture(scope="module")
def back_to_back(ray_cluster, data):
    """Two one-rank engines, the second started as the first closes: the CPUs free before
    them, and each engine with its records. The first is asked for on a wrong guess of
    torch's threads (`torch_threads_guess` + 7, so its actors are asked for again), the
    second on the right one: both must end on what `rank_threads` gives for the CPUs free
    before them (one engine run serves the wrong-guess test and the back-to-back one)."""
    import treeflow.pipeline.ray as ray_engine

    free = wait_for_free_cpus(ray_cluster)  # what the engine will find (an earlier test's
    # actors' CPUs come back a moment after their engine closed)
    runs = []
    for wrong in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if wrong:
                mp.setattr(ray_engine, "torch_threads_guess", lambda: torch.get_num_threads() + 7)
            engine = RayRanks(one_rank_pipe().plan)
            try:
                runs.append((engine, list(engine.run(data))))
            finally:
                engine.close()
    return free, runs


@pytest.mark.ray
def test_a_rank_actor_runs_the_threads_of_the_cpus_ray_gave_it(back_to_back, data):
    pipe = one_rank_pipe()
    engine, records = back_to_back[1][1]  # the engine asked for on the right guess
    assert pa.concat_tables([r.output for r in records]).equals(
        pa.concat_tables([r.output for r in pipe.run(data)]))
    got = records[0].stats["threads"]
    assert got["torch"] == engine.threads <= torch.get_num_threads(), got
    assert got["set_by"].startswith("RayEngine: ") and f"{engine.rank_cpus:g} reserved" in got[
        "set_by"], got
    if "OMP_NUM_THREADS" not in os.environ:  # Ray sets it from the CPUs the actor was given
        assert got["env"]["OMP_NUM_THREADS"] == str(max(1, int(engine.rank_cpus))), got


@pytest.mark.ray
def test_a_wrong_guess_of_torchs_threads_asks_for_the_rank_actors_again(back_to_back, data):
    """The rank actors are asked for before the driver imports torch, on a guess of its thread
    count (pipeline/ray.py `torch_threads_guess`); where torch counts otherwise (a
    hyperthreaded host) they are asked for again, so a rank runs what it ran before.
    back_to_back's first engine was asked for on a guess 7 threads too many."""
    pipe = one_rank_pipe()
    free, ((engine, records), _) = back_to_back
    want = rule(free, engine, pipe)
    got = records[0].stats["threads"]
    assert (engine.threads, engine.rank_cpus, engine.threads_set_by) == want[:3]
    assert got["torch"] == engine.threads and got["set_by"] == want[2], got
    assert pa.concat_tables([r.output for r in records]).equals(
        pa.concat_tables([r.output for r in pipe.run(data)]))


def test_a_guess_that_differs_in_its_words_only_keeps_the_rank_actors(ray_cluster, monkeypatch):
    """Asked for again only for other threads or CPUs: a reason worded otherwise (as on CUDA
    with several ranks, where it names torch's count) keeps the actors, and says the exact one."""
    import treeflow.pipeline.ray as ray_engine

    monkeypatch.setattr(ray_engine, "torch_threads_guess", lambda: torch.get_num_threads() + 7)
    real, asked, asks = RayRanks._rank_threads, RayRanks._rank_actors, []

    def worded(self, free, share, procs, cuda, cores):
        n, cpus, why, warning = real(self, free, share, procs, cuda, torch.get_num_threads())
        return n, cpus, f"{why} (asked with {cores})", warning

    def counted(self, *args):
        asks.append(args)
        return asked(self, *args)

    monkeypatch.setattr(RayRanks, "_rank_threads", worded)
    monkeypatch.setattr(RayRanks, "_rank_actors", counted)
    pipe = one_rank_pipe()
    engine = RayRanks(pipe.plan)
    try:
        # start() alone: the actors are asked for and checked against torch's count there
        # (`_check_threads`); running windows through them would add nothing to what is asked
        engine.start()
    finally:
        engine.close()
    assert len(asks) == 1
    assert engine.threads_set_by.endswith(f"(asked with {torch.get_num_threads()})")


def test_the_guess_of_torchs_threads_is_torchs_count_here(tmp_path):
    """What torch.get_num_threads() gives in a fresh process under its threading variables
    (MKL_NUM_THREADS over OMP_NUM_THREADS, at most the CPUs), guessed without torch."""
    import subprocess
    import sys

    import json

    code = ("import json, torch; from treeflow.pipeline.ray import torch_threads_guess; "
            "print(json.dumps([torch_threads_guess(), torch.get_num_threads()]))")
    cases = [{"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "1"}]
    if _physical_cores() == len(os.sched_getaffinity(0)):  # else torch counts fewer: a guess
        cases += [{}, {"OMP_NUM_THREADS": "999"}]  # known wrong there (RayRanks asks again)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",
                                                             "MKL_NUM_THREADS")}
    # one fresh process per case (torch reads the variables as it starts), all started at
    # once: each spends most of its time importing torch, and none waits for another's
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**base, **env}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for env in cases]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for env, p, (stdout, stderr) in zip(cases, procs, outs):
        assert p.returncode == 0, (env, stderr)
        guess, torch_count = json.loads(stdout.strip().splitlines()[-1])
        assert guess == torch_count, (env, guess, torch_count)


def _physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on."""
    seen = set()
    for cpu in os.sched_getaffinity(0):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as a, open(base + "core_id") as b:
                seen.add((a.read().strip(), b.read().strip()))
        except OSError:
            seen.add((str(cpu), ""))
    return len(seen)


@pytest.mark.ray
def test_an_engine_started_as_the_last_one_closes_plans_on_the_cpus_the_last_one_found(
        back_to_back):
    """Ray frees a killed rank actor's CPUs a moment after ray.kill returns: an engine started
    at once planned on one CPU less (3 of the test cluster's 4, every time), so two identical
    runs in one process ran their ranks differently. It waits for them now."""
    free, runs = back_to_back
    pipe = one_rank_pipe()
    chosen = [(engine.threads, engine.rank_cpus, engine.threads_set_by) for engine, _ in runs]
    want = rule(free, runs[-1][0], pipe)
    assert chosen == [want[:3]] * 2, (free, chosen)


@pytest.mark.ray
def test_cpus_that_do_not_come_back_are_waited_for_briefly_and_said(ray_cluster, capsys,
                                                                    monkeypatch):
    import treeflow.pipeline.ray as ray_engine

    @ray_cluster.remote(num_cpus=1)
    class Holder:
        def ready(self):
            return True

    total = wait_for_free_cpus(ray_cluster)
    holder = Holder.remote()  # another job's actor, holding a CPU the closed engine gave back
    try:
        ray_cluster.get(holder.ready.remote())
        monkeypatch.setattr(ray_engine, "_returning", {"CPU": total})
        ray_engine._wait_returned(ray_cluster, timeout=0.3)
    finally:
        ray_cluster.kill(holder)
    err = capsys.readouterr().err
    assert f"Ray has {total - 1:g} CPU free where its actors' return should make it {total:g}" \
        in err, err
    assert "plans its rank threads on what is free now" in err and not ray_engine._returning
