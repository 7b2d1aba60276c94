"""Data-parallel training from a tensor queue: rank 0 leases each step, every rank gets it.

    reader = QueueSource(episodes_per_step=B, ack="manual").open(q) if rank == 0 else None
    windows = RankWindows(reader, dp)          # the same windows, and positions, on every rank
    for rec in pipe.run(windows, trainer=trainer): ...   # pipe has Shard(num_ranks=dp.world)

A queue step is leased to one consumer, so one process -- rank 0 -- reads the
queue (leases, renewals, staleness, the position of applied steps, acks) and
broadcasts each step's episodes with the reader's position to the other
ranks, over a gloo group of its own (so that the broadcast, which the local
engine may run in its preparation thread, never interleaves with the
training step's collectives on the default group). Every rank then plans the
same bins (Pack, Fragment and Shard are deterministic) and runs its share;
the gradient is summed over ranks as in `replay --num-ranks N`. The end of the
stream (max_steps, or the producers closed the queue) and a reader error are
broadcast too, so no rank waits for a step that never comes.

The trade-off: rank 0 moves every episode once more (Arrow IPC through gloo, train/collectives.py);
the episodes are a small fraction of a step's compute, and a step's loss
weights need all of them on every rank anyway.
"""

from __future__ import annotations

from treeflow.pipeline.source import Source

__all__ = ["RankWindows"]


class RankWindows(Source):
    """A Source of episode windows that rank 0 reads from a QueueReader and every rank gets."""

    def __init__(self, reader, dp):
        import torch.distributed as dist

        if (reader is None) != (dp.rank != 0):
            raise ValueError("RankWindows: give rank 0 the QueueReader and the other ranks None")
        self.reader, self.dp = reader, dp
        self._group = dist.new_group(backend="gloo") if dp.distributed else None  # every rank calls
        self._position = None

    def next(self):
        box = [None]
        if self.dp.rank == 0:
            try:
                episodes = next(self.reader)
                box[0] = ("step", episodes, self.reader.get_state())
            except StopIteration:
                box[0] = ("end", None, None)
            except BaseException as e:
                box[0] = ("error", f"{type(e).__name__}: {e}", None)
                self._send(box)
                raise
        self._send(box)
        kind, payload, position = box[0]
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise RuntimeError(f"rank 0 stopped reading the queue ({payload}); every rank stops")
        self._position = position
        return payload

    def _send(self, box) -> None:
        if self._group is not None:
            from treeflow.train.collectives import broadcast

            box[0] = broadcast(box[0], src=0, group=self._group)  # JSON and Arrow, no pickle

    def reset(self, state: dict | None = None) -> None:
        """Every rank continues from `state`; rank 0's reader resets to it."""
        if self.reader is not None:
            self.reader.reset(state)
        self._position = state

    def get_state(self) -> dict | None:
        """The reader's position after the last window (the queue steps applied), on every rank."""
        return self._position
