"""What a queue's ledger and its transports share: the values that cross, the errors, the calls.

A ledger (tq/ledger.py) may run in this process, in a local server process
(tq/embedded.py, over a Unix socket or TCP) or in a Ray actor
(tq/transferqueue.py); whichever, its clients see the same things: `Group`
(what a put carries) and `Delivery` (what a get leases), the `END` marker, the
errors `QueueFull` and `QueueClosed`, the close rule (`CLOSE_WHEN`,
`parse_close_when`), the methods a served ledger answers (`LEDGER_METHODS`) and
how long a transport waits for each answer (`call_deadline`: the call's own
wait plus `CALL_SLACK_S`). The wire codec (tq/wire.py) encodes exactly the
dataclasses and errors listed in `__all__` here, nothing else.

The trade-off: one flat deadline slack for every call, instead of one per
method: a server slower than a minute on a bookkeeping call is hung or
overloaded either way, and one number is easy to reason about and to patch in
a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CALL_SLACK_S", "CLOSE_WHEN", "END", "IDLE_TIMEOUT_S", "LEDGER_METHODS", "Delivery",
           "Group", "QueueClosed", "QueueFull", "call_deadline", "check_groups", "parse_close_when"]

END = "end"  # get(): the queue is closed and nothing more can reach this consumer
CLOSE_WHEN = ("all", "first")  # or a number of producers
# the methods a served ledger exposes to its clients (every backend's transport proxies these)
LEDGER_METHODS = ("next_seq", "open_producer", "renew_producer", "put", "close", "get", "renew", "ack",
                  "nack", "reject", "put_result", "take_result", "publish_weights", "weights",
                  "dead_letters", "stats")
# where a method takes its own wait (seconds), by position; a transport's deadline is that plus
# CALL_SLACK_S, past which the server is presumed hung or gone
WAIT_ARGS = {"put": 5, "get": 2, "put_result": 2, "take_result": 0, "open_producer": 2}
CALL_SLACK_S = 60.0
# a consumer's default wait for a step while no producer is heard from: a producer that failed
# ends its consumers with a message instead of leaving them waiting for ever
IDLE_TIMEOUT_S = 300.0


def call_deadline(method: str, args: tuple, kwargs: dict | None = None) -> float:
    """Seconds a call of `method` with these arguments may take before its transport gives up."""
    at = WAIT_ARGS.get(method)
    wait = (kwargs or {}).get("wait_s")
    if wait is None and at is not None and len(args) > at:
        wait = args[at]
    return float(wait or 0.0) + CALL_SLACK_S


class QueueFull(RuntimeError):
    """A put found no room within its wait (the consumer is slower than the producers)."""


class QueueClosed(RuntimeError):
    """A put after close()."""


@dataclass
class Group:
    """One whole group of episodes (a GRPO group, or one ungrouped episode) and its payload."""

    payload: Any
    episodes: int
    nbytes: int
    min_version: int | None
    group_id: str | None = None
    producer: str | None = None   # set by the ledger at put (messages name it), never sent


def check_groups(groups, producer: str, seq: int, episode_ids: list, sample_indices: list) -> int:
    """The episodes `groups` hold, once each group's declared fields are the right kinds and
    add up to the episode ids and sample indices the put names; ValueError naming the put."""
    where = f"put {seq} of producer {producer!r}"
    if not isinstance(groups, list) or not groups:
        raise ValueError(f"{where}: holds no groups; put whole groups (Queue.put cuts them)")
    n = 0
    for i, g in enumerate(groups):
        if not isinstance(g, Group):
            raise ValueError(f"{where}: group {i} is a {type(g).__name__}, not a Group")
        for name, ok in (("episodes", _count(g.episodes, 1)), ("nbytes", _count(g.nbytes, 0)),
                         ("min_version", g.min_version is None or _count(g.min_version, None)),
                         ("group_id", g.group_id is None or isinstance(g.group_id, str))):
            if not ok:
                raise ValueError(f"{where}: group {i} declares {name}={getattr(g, name)!r}; "
                                 "a producer's groups are cut by Queue.put, which fills these")
        n += g.episodes
    if not (isinstance(episode_ids, list) and isinstance(sample_indices, list)) or \
            len(episode_ids) != n or len(sample_indices) != n:
        raise ValueError(f"{where}: its groups declare {n} episodes but it names "
                         f"{len(episode_ids)} episode ids and {len(sample_indices)} sample "
                         "indices; put whole groups through Queue.put, which counts them")
    return n


def _count(v, least: int | None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (least is None or v >= least)


@dataclass
class Delivery:
    """A leased step: its number, its groups' payloads, and what was dropped to form it."""

    lease: int
    step: int
    payloads: list
    episodes: int
    redelivered: bool = False
    dropped_stale: int = 0


def parse_close_when(value) -> str | int:
    """"all", "first" or a number N >= 1 of producers (a string of digits is a number)."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not (value in CLOSE_WHEN or (isinstance(value, int) and value >= 1)):
        raise ValueError(f"close_when={value!r}: choose 'all' (the queue closes when every "
                         "producer has closed), 'first', or a number N >= 1 of producers")
    return value
