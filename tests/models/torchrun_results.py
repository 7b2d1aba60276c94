"""How the torchrun workers of the models tests end (megatron_tp_worker.py, megatron_ckpt_worker.py)."""

from __future__ import annotations

import json

import torch.distributed as dist


def report(results: list, out: str) -> None:
    """Rank 0 writes `results` to `out` as JSON; every rank waits for it, then leaves the group.

    The barrier keeps the other ranks alive until the file is written, so that torchrun sees
    every rank exit cleanly and the caller finds the file.
    """
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
