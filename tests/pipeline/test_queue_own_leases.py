"""Every training rank leasing its own part of each queue step trains as rank 0 leasing them all.

Two spawned ranks (gloo) read one embedded queue served here on a Unix socket. With
`RankWindows(own=True)` each rank leases steps of 2 episodes (one GRPO group) and the ranks
all-gather them into windows of 4; with `RankWindows(reader on rank 0)` rank 0 leases steps of 4
and broadcasts them. The same windows in the same order, so the same bins: losses and final
weights bit for bit. A restart: the own-lease run stops after 2 of 4 steps with its checkpoint
written but nothing acknowledged (a crash between the two), its leases lapse, the 4 parts come
back to the resumed ranks, which skip them (the checkpoint's position is the union of both
ranks' applied steps) and train steps 3-4: again the uninterrupted run's weights, every part
acknowledged, none applied twice.
"""

import pytest
import torch

from treeflow.tools import synth_episodes
from treeflow.tq import open_queue
from treeflow.train.launch import spawn

pytestmark = pytest.mark.multiprocess

B = 4


def _rank(address, own, steps, ckpt, resume, ack):
    from treeflow.pipeline import Pipeline, QueueSource, RankWindows
    from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce, Shard
    from treeflow.tq import connect_queue
    from treeflow.train import DataParallel, Trainer

    dp = DataParallel.from_env("cpu")
    fwd = Forward(model="tiny")
    red = Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=1e-2))
    trainer = Trainer.resume(ckpt, fwd, red, dp=dp) if resume else Trainer(fwd, red, dp=dp)
    reader = None
    if own or dp.rank == 0:
        reader = QueueSource(episodes_per_step=B // dp.world if own else B, ack="manual",
                             max_steps=steps).open(connect_queue(address), trainer.position)
    windows = RankWindows(reader, dp, own=own)
    windows.reset(trainer.position)
    r, n = dp.rank, dp.world
    pipe = Pipeline(Pack(layout="tree"), Fragment(max_tokens=512), Shard(), fwd,
                    red).for_rank(n, r, dp.planning_exchange())
    losses = []
    for rec in pipe.run(windows, trainer=trainer):
        losses.append(rec.output.column("loss")[0].as_py())
        trainer.position = rec.position
    trainer.save(ckpt)
    skipped = reader.skipped if reader is not None else 0
    if ack and reader is not None:
        reader.commit(trainer.position)   # the checkpoint holds every window's parts
        reader.close()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    dp.close()
    return {"losses": losses, "weights": weights, "skipped": skipped,
            "position": {k: v for k, v in trainer.position.items() if k != "queue_step"}}


def _queue(tmp_path, name):
    q = open_queue(str(tmp_path / f"{name}.sock"), capacity=64, lease_seconds=2.0)
    eps = synth_episodes(episodes=16, group_size=2, turns=(1, 3), system_tokens=12,
                         user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5), seed=5)
    for k in range(0, eps.num_rows, 2):
        q.put(eps.slice(k, 2), producer="rollout")
    q.close()
    return q


def _run(q, tmp_path, name, own, steps, resume=False, ack=True):
    return spawn(_rank, 2, q._owner.address, own, steps, str(tmp_path / name), resume, ack,
                 timeout_s=300, threads=1)


def _same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# the CLI's --lease per-rank test (tests/test_cli_stream.py) runs the same equality and a kill
# and resume in the default run
@pytest.mark.slow
def test_ranks_leasing_their_own_parts_train_as_rank_0_leasing_every_step(tmp_path):
    q0 = _queue(tmp_path, "rank0")
    want = _run(q0, tmp_path, "rank0", own=False, steps=4)
    q1 = _queue(tmp_path, "own")
    got = _run(q1, tmp_path, "own", own=True, steps=4)
    try:
        assert len(want[0]["losses"]) == 4
        for w, g in zip(want, got):
            assert g["losses"] == w["losses"]
        _same(got[0]["weights"], want[0]["weights"])
        # every rank holds the union of the ranks' applied steps: all 8 parts, 16 episodes
        assert got[0]["position"] == got[1]["position"] == {
            "episodes": 16, "queue_steps_through": 7, "queue_steps_extra": []}
        assert want[0]["position"]["queue_steps_through"] == 3  # rank 0's 4 whole steps
        s0, s1 = q0.stats(), q1.stats()
        assert (s0["steps_released"], s1["steps_released"]) == (4, 8)  # 8 parts of 2 episodes
        assert s1["steps_acked"] == 8 and s1["leased_steps"] == 0 and s1["queued_episodes"] == 0

        # the restart: 2 steps, the checkpoint written, nothing acknowledged; then resumed
        q2 = _queue(tmp_path, "restart")
        first = _run(q2, tmp_path, "restart", own=True, steps=2, ack=False)
        assert q2.stats()["steps_acked"] == 0
        rest = _run(q2, tmp_path, "restart", own=True, steps=2, resume=True)
        assert [r["losses"] for r in first] == [want[0]["losses"][:2]] * 2
        assert rest[0]["losses"] == want[0]["losses"][2:]
        _same(rest[0]["weights"], want[0]["weights"])
        s2 = q2.stats()
        # the 4 parts of steps 1-2 came back once their leases lapsed, and were skipped
        assert sum(r["skipped"] for r in rest) == 4 and s2["redeliveries"] == 4
        assert s2["steps_released"] == 8 and s2["steps_acked"] == 8 and s2["leased_steps"] == 0
    finally:
        for q in (q0, q1):
            q.shutdown()
        if "q2" in locals():
            q2.shutdown()
