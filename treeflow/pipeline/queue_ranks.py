"""Data-parallel training from a tensor queue: rank 0 leases each step, every rank gets it.

    reader = QueueSource(episodes_per_step=B, ack="manual").open(q) if rank == 0 else None
    windows = RankWindows(reader, dp)          # the same windows, and positions, on every rank
    for rec in pipe.run(windows, trainer=trainer): ...   # pipe bound to dp.world ranks

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

`own=True`: every rank leases its own part of each step instead (its reader's steps are the
step's episodes / ranks; no rank leases or sends for all) and the ranks all-gather their parts.
The window is the parts in queue-step order: the ledger numbers steps as it releases them from
the head of the queue, and the all-gather is a barrier (every part of window k is released
before any part of window k+1), so where the parts cut the queue where one whole step would
(whole groups per part), every rank trains on the window rank 0 would have leased. No loss, no
duplicate: producers' sequence numbers are the queue's as before; each part is leased to one
rank and acknowledged by it once a checkpoint holds it; the position is the union of the
ranks' applied queue steps (saved by rank 0, restored on every rank), so after a restart a
part redelivered to any rank is skipped if any rank had applied it; during a run every reader
is told the other ranks' parts (`QueueReader.applied`), so one redelivered to it after a lapsed
lease is held, not yielded, and acknowledged with its own once durable. A rank whose reader
ends (max_steps; the queue closed and drained) while another still got a part trains on the
parts there are, as one reader trains on a closed queue's remainder.
"""

from __future__ import annotations

from treeflow.pipeline.source import Source
from treeflow.schemas.episode import concat_episodes

__all__ = ["RankWindows"]


class RankWindows(Source):
    """A Source of episode windows that rank 0 reads from a QueueReader and every rank gets."""

    def __init__(self, reader, dp, *, own: bool = False):
        import torch.distributed as dist

        if own and reader is None:
            raise ValueError("RankWindows(own=True): give every rank its own QueueReader")
        if not own and (reader is None) != (dp.rank != 0):
            raise ValueError("RankWindows: give rank 0 the QueueReader and the other ranks None")
        self.reader, self.dp, self.own = reader, dp, own
        self._group = dist.new_group(backend="gloo") if dp.distributed else None  # every rank calls
        # own: the windows' union starts from the reader's position (a resumed run's checkpoint)
        self._position = reader.get_state() if own else None

    def next(self):
        if self.own:
            return self._gathered()
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

    def _gathered(self):
        try:
            part = next(self.reader)
            mine = ("step", part, self.reader.get_state()["queue_step"])
        except StopIteration:
            mine = ("end", None, None)
        except BaseException as e:
            mine = ("error", f"{type(e).__name__}: {e}", None)
            self._all(mine)
            raise
        every = self._all(mine)
        failed = [f"rank {r}: {m[1]}" for r, m in enumerate(every) if m[0] == "error"]
        if failed:
            raise RuntimeError(f"a rank stopped reading the queue ({'; '.join(failed)}); every "
                               "rank stops")
        parts = sorted((m[2], m[1]) for m in every if m[0] == "step")
        if not parts:
            raise StopIteration
        steps = [q for q, _ in parts]
        self.reader.applied(steps)
        window = concat_episodes([t for _, t in parts])
        self._position = _union(self._position, steps, window.num_rows)
        return window

    def _all(self, mine) -> list:
        if self._group is None:
            return [mine]
        from treeflow.train.collectives import all_gather

        return all_gather(mine, group=self._group)  # JSON and Arrow, no pickle

    def commit(self, position: dict | None = None) -> None:
        """`position` is durable (a checkpoint holds it, or its metrics are out): this rank's
        reader (if any) acknowledges the steps it holds that the position names (own: its
        part of each window, and other ranks' parts redelivered to it)."""
        if self.reader is not None:
            self.reader.commit(position)

    def reset(self, state: dict | None = None) -> None:
        """Every rank continues from `state`; rank 0's reader resets to it (own: every rank's)."""
        if self.reader is not None:
            self.reader.reset(state)
        self._position = state

    def get_state(self) -> dict | None:
        """The reader's position after the last window (the queue steps applied), on every rank."""
        return self._position


def _union(position: dict | None, steps: list[int], episodes: int) -> dict:
    """`position` (a reader's state) with queue `steps` applied and `episodes` more taken."""
    position = position or {}
    through = int(position.get("queue_steps_through", -1))
    extra = set(int(q) for q in position.get("queue_steps_extra", ())) | set(steps)
    while through + 1 in extra:
        through += 1
        extra.discard(through)
    return {"queue_step": max(steps), "episodes": int(position.get("episodes", 0)) + episodes,
            "queue_steps_through": through, "queue_steps_extra": sorted(extra)}
