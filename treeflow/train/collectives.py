"""Values between the ranks of one run, as wire frames (JSON and Arrow IPC), never pickled.

`torch.distributed.broadcast_object_list` and `all_gather_object` pickle the value on one
rank and unpickle it on the others, so whatever can write to a rank's process-group
connection can run code in it. Here the value becomes a wire frame (tq/wire.py: JSON
values, tuples, Arrow tables) sent as a uint8 tensor, its length first: a step's
episodes with the reader's position (pipeline/queue_ranks.py), a checkpoint's
temporary path (train/checkpoint.py), a failed rank's message (train/distributed.py).

The trade-off: none in traffic (the same two collectives as torch's: a length, then the
bytes), but only what a frame can carry travels; anything else is a TypeError on the
sending rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from treeflow.tq.wire import pack, unpack

__all__ = ["all_gather", "broadcast"]


def _device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")


def broadcast(value, *, src: int, group):
    """`value` of rank `src` on every rank of `group`, as a frame (JSON and Arrow, no pickle).

    What `dist.broadcast_object_list` does, without unpickling what another process sent.
    """
    device = _device(group)
    mine = dist.get_rank() == src
    data = pack(value) if mine else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(n, src=src, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if mine else
           torch.empty(int(n.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=src, group=group)
    return value if mine else unpack(bytes(buf.cpu().numpy()))


def all_gather(value, *, group) -> list:
    """Every rank's `value` (JSON values), in rank order, without pickle."""
    device, world = _device(group), dist.get_world_size(group)
    data = pack(value)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [unpack(bytes(t.cpu().numpy()[:int(s.item())])) for t, s in zip(every, sizes)]
