"""The spread of tests/examples/test_grpo_toy.py's learning gain over rollout seeds (JSON).

    python bench/grpo_toy_margins.py --steps 30 --seeds 0-29 --lr 0.05
    python bench/grpo_toy_margins.py --steps 30 --seeds 0-19 --lr 0

The test's margin must hold on every CPU model, where float32 rounding sends the on-policy
loop down another trajectory; other seeds sample that spread. Prints one JSON line per seed
(gain = last five steps' mean reward minus the first five's) and a summary.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import numpy as np
import torch

from treeflow.programs import Rollout

_PATH = os.path.join(os.path.dirname(__file__), "..", "examples", "grpo_toy.py")


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", default="0-29", help="a range, e.g. 0-29")
    p.add_argument("--lr", type=float, default=5e-2)
    args = p.parse_args()
    torch.set_num_threads(1)  # as the test runs
    spec = importlib.util.spec_from_file_location("grpo_toy", _PATH)
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    gains = []
    for seed in _seeds(args.seeds):
        rollout = Rollout(group_size=4, turns=(2, 2), prompt_tokens=(4, 6),
                          completion_tokens=(3, 5), tool_tokens=(2, 3), seed=seed)
        t0 = time.perf_counter()
        r = np.array([x["reward_mean"] for x in toy.train(rollout=rollout, groups_per_step=2,
                                                          steps=args.steps, lr=args.lr)])
        gains.append(float(r[-5:].mean() - r[:5].mean()))
        print(json.dumps({"seed": seed, "gain": round(gains[-1], 3),
                          "first5": round(float(r[:5].mean()), 3),
                          "last5": round(float(r[-5:].mean()), 3),
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    g = np.array(gains)
    print(json.dumps({"steps": args.steps, "lr": args.lr, "seeds": len(g),
                      "gain_min": round(float(g.min()), 3), "gain_median": round(float(np.median(g)), 3),
                      "gain_max": round(float(g.max()), 3), "gain_std": round(float(g.std()), 3)}))


if __name__ == "__main__":
    main()
