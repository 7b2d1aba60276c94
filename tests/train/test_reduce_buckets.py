"""The gradient all-reduce's buckets, against bucketings and sums written out by hand.

Both reductions cut the gradients into buckets of one dtype and device of at
most `bucket` elements (a tensor larger than a bucket goes alone): the
reduction after backward (`DataParallel.sum_tensors`) and the one overlapped
with backward (`GradReducer`, in reverse registration order). The real
models of the other tests fit in one 2^26-element bucket, so a wrong cut
there is never exercised; here the limit is 10 elements.
"""

from __future__ import annotations

import pytest
import torch

from treeflow.train.launch import spawn
from treeflow.train.overlap import GradReducer

LIMIT = 10
# (numel, dtype) in the order given: float32 3+7 fills a bucket exactly, 12 is larger than one,
# float64 11 opens its dtype's buckets alone; dtypes are bucketed apart, in order of first use
TENSORS = [(3, torch.float32), (11, torch.float64), (7, torch.float32), (6, torch.int64),
           (12, torch.float32), (1, torch.float64), (4, torch.float32), (5, torch.float32),
           (2, torch.float32)]
CALLS = [(10, torch.float32), (12, torch.float32), (9, torch.float32), (2, torch.float32),
         (11, torch.float64), (1, torch.float64), (6, torch.int64)]


def _value(i: int, n: int, dtype, rank: int) -> torch.Tensor:
    return (torch.arange(n) + 100 * i + 1000 * rank).to(dtype)


def _sum_ranks():
    import torch.distributed as dist

    import treeflow.train.distributed as distributed
    from treeflow.train import DataParallel

    dp = DataParallel.from_env("cpu")
    distributed.BUCKET_ELEMENTS = LIMIT
    calls, real = [], dist.all_reduce

    def spy(t, *a, **k):
        calls.append((t.numel(), t.dtype))
        return real(t, *a, **k)

    dist.all_reduce = spy
    tensors = [_value(i, n, dt, dp.rank).reshape(-1, 1) if n % 2 == 0 else _value(i, n, dt, dp.rank)
               for i, (n, dt) in enumerate(TENSORS)]
    dp.sum_tensors(tensors)
    dist.all_reduce = real
    dp.close()
    return {"calls": calls, "tensors": tensors}


@pytest.mark.multiprocess
def test_sum_tensors_cuts_buckets_by_dtype_and_size_and_sums_every_element():
    runs = spawn(_sum_ranks, 2, timeout_s=120, threads=1)
    for r in runs:
        assert r["calls"] == CALLS
        for i, ((n, dt), got) in enumerate(zip(TENSORS, r["tensors"])):
            want = _value(i, n, dt, 0) + _value(i, n, dt, 1)
            assert got.dtype == dt and torch.equal(got.reshape(-1), want), i


def test_grad_reducer_buckets_follow_reverse_registration_order_dtype_and_size():
    sizes = [(2, torch.float32), (5, torch.float32), (3, torch.float32), (12, torch.float32),
             (4, torch.float32), (4, torch.float32)]
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in sizes]
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    reducer = GradReducer(params[:3] + [frozen] + params[3:], None, bucket_elements=LIMIT)
    try:
        # reversed: 4 4 | 12 (alone) | 3 5 2 (exactly 10); the frozen one takes no part
        assert [[sizes[i][0] for i in b] for b in reducer.buckets] == [[4, 4], [12], [3, 5, 2]]
        assert len(reducer.params) == 6
    finally:
        reducer.remove()
    sizes[1] = (5, torch.float64)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in sizes]
    reducer = GradReducer(params, None, bucket_elements=LIMIT)
    try:
        assert [[(sizes[i][0], sizes[i][1]) for i in b] for b in reducer.buckets] == [
            [(4, torch.float32), (4, torch.float32)], [(12, torch.float32)],
            [(3, torch.float32)], [(5, torch.float64)], [(2, torch.float32)]]
    finally:
        reducer.remove()
