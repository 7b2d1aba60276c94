"""How the torchrun workers of the models tests end (megatron_tp_worker.py, megatron_ckpt_worker.py)."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist


def report(results: list, out: str) -> None:
    """Rank 0 writes `results` to `out` as JSON; every rank waits for it, leaves the group and
    ends the process (never returns).

    The barrier keeps the other ranks alive until the file is written, so that torchrun sees
    every rank exit cleanly and the caller finds the file. The process then ends without the
    interpreter's teardown, as treeflow's console script does (cli/main.py): gloo's worker
    threads can abort a process during that teardown ("terminate called without an active
    exception", once in CI on a loaded machine; where in the run is not known).
    """
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
