"""Shared data and reference (legacy, in-memory) runs for the queue tests."""

import torch

from treeflow.pipeline import Pipeline, QueueSource, windows
from treeflow.tools import synth_episodes
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reassemble, Reduce
from treeflow.train import Trainer

from tests.ray_helpers import wait_for_free_cpus

B = 4  # episodes per step (two groups of two)


def small_episodes():
    return synth_episodes(episodes=12, group_size=2, turns=(1, 3), system_tokens=12,
                          user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 5), seed=5)


def logprob_pipe():
    return Pipeline(Pack(layout="tree"), Fragment(max_tokens=512), Forward(model="tiny"), Reassemble())


def train_parts():
    fwd = Forward(model="tiny")
    red = Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=1e-2))
    return Pipeline(Pack(layout="tree"), Fragment(max_tokens=512), fwd, red), fwd, red


def legacy_logprobs(eps):
    return [rec.output for rec in logprob_pipe().run(windows(iter([eps]), B))]


def legacy_training(eps):
    pipe, fwd, red = train_parts()
    trainer = Trainer(fwd, red)
    losses = [rec.output.column("loss")[0].as_py()
              for rec in pipe.run(windows(iter([eps]), B), trainer=trainer)]
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def fill(queue, eps, chunk=2, close=True):
    for k in range(0, eps.num_rows, chunk):
        queue.put(eps.slice(k, chunk), producer="test")
    if close:
        queue.close()


def queued_logprobs(queue):
    return [rec.output for rec in logprob_pipe().run(QueueSource(episodes_per_step=B).open(queue))]


def queued_training(queue, trainer=None, **source_options):
    """Train on the queue's steps (continuing `trainer` from its saved queue position)."""
    pipe, fwd, red = train_parts()
    trainer = trainer or Trainer(fwd, red)
    reader = QueueSource(episodes_per_step=B, **source_options).open(queue, trainer.position)
    losses = []
    for rec in pipe.run(reader, trainer=trainer):
        losses.append(rec.output.column("loss")[0].as_py())
        trainer.position = rec.position
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, reader


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def close_transferqueue(ray, timeout: float = 30.0):
    """Stop TransferQueue (if a test started it) and wait until its actors' CPUs are free again.

    The Ray cluster is the session's: the next module must find it as the first one did.
    """
    import sys

    if sys.modules.get("transfer_queue") is None:
        return
    from treeflow.tq.transferqueue import stop_transferqueue

    stop_transferqueue()
    try:
        wait_for_free_cpus(ray, timeout)
    except TimeoutError as e:
        raise TimeoutError(f"TransferQueue closed, but {e}") from None
