"""The K/V exchange of a context-parallel group, blocking or in flight behind local compute.

Per layer every rank sends the rows of its K/V that other ranks' queries need
(their first node's ancestors) in one all_to_all, and backward returns those
rows' gradients to their owners in the reverse all_to_all, summed into the
rows that were sent (a row read by several ranks gets all their gradients).

`exchange` does it in one blocking call (an autograd Function). `start` and
`finish` split it around compute that needs no received row (the queries
over their own keys): `start` issues the asynchronous all_to_all and returns
the receive buffer, `finish` waits for it; the buffer is only ever read
through `finish`'s output, so nothing can read it before the wait. Backward
runs the other way: `finish`'s backward issues the reverse all_to_all (the
received rows' gradients are known once the received part of attention has
run backward) and `start`'s backward waits for it. Autograd runs the local
part's backward in between (it was recorded after `start` and runs first),
so the reverse exchange is in flight behind it. With gloo the transfer runs on
gloo's thread; with NCCL on its stream.

Legend: n rows this rank holds, r rows it receives, s rows it sends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Pending", "exchange", "finish", "start"]


class Pending:
    """An exchange in flight: its work handle and the buffers that must outlive it."""

    __slots__ = ("work", "buffers")

    def __init__(self) -> None:
        self.work, self.buffers = None, ()

    def wait(self) -> None:
        assert self.work is not None, "no exchange in flight"
        self.work.wait()
        self.work, self.buffers = None, ()


def exchange(kv_n, send_idx, send_splits, recv_splits, group) -> torch.Tensor:
    """Rows `send_idx` of kv_n to the ranks that need them; the rows this rank receives."""
    return _Exchange.apply(kv_n, send_idx, send_splits, recv_splits, group)


def start(kv_n, send_idx, send_splits, recv_splits, group) -> tuple[torch.Tensor, Pending]:
    """Issue the exchange; returns (the receive buffer, not yet filled, and its Pending)."""
    pending = Pending()
    return _Start.apply(kv_n, send_idx, send_splits, recv_splits, group, pending), pending


def finish(recv_r, pending: Pending, send_splits, recv_splits, group) -> torch.Tensor:
    """Wait for the exchange `start` issued; the received rows, safe to read."""
    return _Finish.apply(recv_r, pending, send_splits, recv_splits, group)


def _send(kv_n, send_idx, recv_splits):
    send_s = kv_n.index_select(0, send_idx).contiguous()
    return send_s, kv_n.new_empty((sum(recv_splits), *kv_n.shape[1:]))


def _returned(grad_send_s, send_idx, rows: int) -> torch.Tensor:
    grad_kv = grad_send_s.new_zeros((rows, *grad_send_s.shape[1:]))
    return grad_kv.index_add_(0, send_idx, grad_send_s)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv_n, send_idx, send_splits, recv_splits, group):
        ctx.save_for_backward(send_idx)
        ctx.splits, ctx.group, ctx.rows = (send_splits, recv_splits), group, kv_n.shape[0]
        send_s, recv_r = _send(kv_n, send_idx, recv_splits)
        dist.all_to_all_single(recv_r, send_s, recv_splits, send_splits, group=group)
        return recv_r

    @staticmethod
    def backward(ctx, grad_recv_r):
        (send_idx,) = ctx.saved_tensors
        send_splits, recv_splits = ctx.splits
        grad_send_s = grad_recv_r.new_empty((sum(send_splits), *grad_recv_r.shape[1:]))
        dist.all_to_all_single(grad_send_s, grad_recv_r.contiguous(), send_splits, recv_splits,
                               group=ctx.group)
        return _returned(grad_send_s, send_idx, ctx.rows), None, None, None, None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv_n, send_idx, send_splits, recv_splits, group, pending):
        ctx.save_for_backward(send_idx)
        ctx.pending, ctx.rows = pending, kv_n.shape[0]
        send_s, recv_r = _send(kv_n, send_idx, recv_splits)
        pending.work = dist.all_to_all_single(recv_r, send_s, recv_splits, send_splits,
                                              group=group, async_op=True)
        pending.buffers = (send_s, recv_r)
        return recv_r

    @staticmethod
    def backward(ctx, _grad_placeholder):
        (send_idx,) = ctx.saved_tensors
        grad_send_s = ctx.pending.buffers[0]  # what _Finish.backward's reverse exchange fills
        ctx.pending.wait()
        return _returned(grad_send_s, send_idx, ctx.rows), None, None, None, None, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv_r, pending, send_splits, recv_splits, group):
        pending.wait()
        ctx.pending, ctx.splits, ctx.group = pending, (send_splits, recv_splits), group
        return recv_r.view_as(recv_r)

    @staticmethod
    def backward(ctx, grad_recv_r):
        send_splits, recv_splits = ctx.splits
        grad_recv_r = grad_recv_r.contiguous()
        grad_send_s = grad_recv_r.new_empty((sum(send_splits), *grad_recv_r.shape[1:]))
        ctx.pending.work = dist.all_to_all_single(grad_send_s, grad_recv_r, send_splits,
                                                  recv_splits, group=ctx.group, async_op=True)
        ctx.pending.buffers = (grad_send_s, grad_recv_r)
        return grad_recv_r, None, None, None, None
