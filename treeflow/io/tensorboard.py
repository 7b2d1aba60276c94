"""Training metrics to TensorBoard, next to the metrics JSONL.

One scalar per numeric metric per optimizer step, tagged by its namespaced name
("train/loss", "rollout/gen_kl"; a flat NAME becomes "train/NAME"), written
with torch's `SummaryWriter` (event files under the given directory; view
with `tensorboard --logdir DIR`). Non-numeric and non-finite values are
skipped, as TensorBoard cannot plot them; the JSONL keeps everything. The
step axis is the optimizer step, and the episodes consumed are logged as
their own scalar, since the schedule counts episodes.
"""

from __future__ import annotations

import math
import os


class TensorBoardLog:
    """Append per-step metric rows to TensorBoard event files in `logdir`."""

    def __init__(self, logdir: str | os.PathLike):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ValueError('--tensorboard needs the tensorboard package: '
                             'pip install "treeflow[tensorboard]"') from e
        self.logdir = os.fspath(logdir)
        self._writer = SummaryWriter(log_dir=self.logdir)

    def write(self, step: int, row: dict) -> int:
        """Log the numeric values of `row` at `step`; returns how many scalars were written."""
        n = 0
        for key, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or key == "step":
                continue
            if not math.isfinite(value):
                continue
            self._writer.add_scalar(key if "/" in key else f"train/{key}", value,
                                    global_step=step)
            n += 1
        self._writer.flush()
        return n

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
