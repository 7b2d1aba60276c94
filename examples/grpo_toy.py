"""GRPO on a toy tool-use task, with treeflow's live loop: a policy that learns from rewards.

    python examples/grpo_toy.py --steps 40 --plot grpo_toy.png --json grpo_toy.json

The environment (`AnswerLow`, written here as a user writes one) gives every
episode a prompt and, between its calls, a tool output (tokens of the upper
half of the vocabulary). The reward is the share of the tokens sampled
after a tool output that are target tokens (ids below vocab/2): the policy
must answer the tool in the other half. A random policy scores about 0.5.
Advantages are GRPO's, computed here per group from the rewards
(`AnswerLow.advantages`: group-normalised, (r - mean) / (std + eps)).

The loop is the one `treeflow rollout` + `treeflow stream --mode train` run,
in one process and with public names only: a producer thread samples groups
from the current policy (`run_rollout` with this environment) into a tensor
queue; the trainer leases one step of whole groups at a time
(`QueueSource`), runs one optimizer step (`Pipeline(...).run(reader,
trainer=trainer)`), and publishes the new weights on the queue, which the
producer loads before it samples the next step (refit). `max_lag=0` makes
the producer wait for the weights of the step it samples for and
`max_staleness=0` makes the trainer refuse anything older, so the run is
on-policy and deterministic given the seeds: the tree and exact layouts
give the same rewards step by step (`--layouts tree,exact` checks it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time

import numpy as np

from treeflow.pipeline import Pipeline, QueueSource
from treeflow.programs import Environment, Rollout, run_rollout
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reduce
from treeflow.tq import open_queue
from treeflow.train import Trainer


class AnswerLow(Environment):
    """Reward: the share of tokens sampled after a tool output that are target tokens (id < vocab/2)."""

    def tool(self, rng, config, vocab, context, call):
        # the tool answers with a few tokens of the upper half: nothing to copy from
        n = int(rng.integers(config.tool_tokens[0], config.tool_tokens[1] + 1))
        return rng.integers(vocab // 2, vocab, size=n, dtype=np.int32)

    def reward(self, calls: list[dict], vocab: int) -> float:
        after_tool = calls[1:]            # call k >= 1 follows the tool output of call k-1
        sampled = np.concatenate([np.asarray(c["token_ids"][c["sampled_start"]:])
                                  for c in after_tool])
        return float(np.mean(sampled < vocab // 2))

    def advantages(self, reward_G: np.ndarray) -> np.ndarray:
        # GRPO: each episode against its group's mean, in units of the group's spread
        return (reward_G - reward_G.mean()) / (reward_G.std() + 1e-6)


def train(*, steps: int = 40, groups_per_step: int = 4, group_size: int = 4, lr: float = 5e-2,
          layout: str = "tree", seed: int = 0, rollout: Rollout | None = None,
          model: str = "tiny", log=None) -> list[dict]:
    """Run the loop; one dict per optimizer step (mean reward of the step's episodes, loss, ...)."""
    config = rollout or Rollout(group_size=group_size, turns=(2, 3), prompt_tokens=(6, 10),
                                completion_tokens=(4, 8), tool_tokens=(2, 4), seed=seed)
    per_step = groups_per_step * config.group_size
    queue = open_queue(None, capacity=2 * per_step)          # in this process
    weights = tempfile.mkdtemp(prefix="grpo-toy-weights-")
    errors: list[BaseException] = []

    def produce():
        try:
            run_rollout(queue, groups=steps * groups_per_step, config=config, model=model,
                        env=AnswerLow(), groups_per_step=groups_per_step, max_lag=0,
                        producer="toy", wait_timeout=300)
        except BaseException as e:  # noqa: BLE001 - reported by the trainer's loop
            errors.append(e)
            queue.close()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    forward = Forward(model=model)
    reduce = Reduce(loss=Loss(kind="pg", norm="seq-mean"), schedule=EpisodeSchedule(lr=lr))
    trainer = Trainer(forward, reduce)
    reader = QueueSource(episodes_per_step=per_step, max_steps=steps,
                         max_staleness=0, idle_timeout=300).open(queue)
    pipe = Pipeline(Pack(layout=layout), Fragment(max_tokens=4096), forward, reduce)
    curve, t0 = [], time.perf_counter()
    try:
        for rec in pipe.run(reader, trainer=trainer):
            row = rec.output.to_pylist()[0]
            rewards = rec.episodes.column("reward").to_numpy()
            versions = set(rec.episodes.column("weight_version").to_pylist())
            assert versions == {trainer.steps - 1}, versions       # on-policy: sampled by v(step-1)
            path = os.path.join(weights, f"v{trainer.steps}")
            trainer.backend.save(path)                               # publish: the producer refits
            queue.publish_weights(trainer.steps, path)
            curve.append({"step": row["step"], "reward_mean": float(rewards.mean()),
                          "loss": row["loss"], "grad_norm": row["grad_norm"],
                          "gen_kl": row["gen_kl"], "seconds": round(time.perf_counter() - t0, 2)})
            if log is not None:
                log(curve[-1])
    finally:
        reader.close()
        queue.close()
        producer.join(timeout=30)
        shutil.rmtree(weights, ignore_errors=True)  # every version the producer refitted from
    if errors:
        raise errors[0]
    return curve


def plot_data(curves: dict[str, list[dict]]) -> dict:
    """What the reward plot shows: each layout's mean reward per step."""
    return {name: {"step": [int(r["step"]) for r in curve],
                   "reward_mean": [float(r["reward_mean"]) for r in curve]}
            for name, curve in curves.items()}


def plot(curves: dict[str, list[dict]], path: str, *, source: str = "examples/grpo_toy.py",
         draw: bool = True) -> None:
    """The reward curves as a PNG, with their data as JSON next to it (treeflow/plots.py)."""
    from matplotlib.figure import Figure

    from treeflow.plots import save_with_data

    data = plot_data(curves)
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    for name, curve in data.items():
        ax.plot(curve["step"], curve["reward_mean"], label=name,
                linestyle="-" if name.startswith("tree") else "--")
    ax.axhline(0.5, color="grey", lw=0.8, label="chance")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the step's episodes")
    ax.set_title("GRPO on the AnswerLow tool task (tiny policy, CPU)")
    ax.legend()
    fig.set_dpi(110)
    fig.tight_layout()
    save_with_data(fig, path, data, source=source, draw=draw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default="tree,exact", help="comma-separated; each runs the loop")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--plot", default=None, help="PNG of the reward curves")
    p.add_argument("--json", default=None, help="write the curves as JSON here")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    curves = {}
    for layout in args.layouts.split(","):
        curves[layout] = train(steps=args.steps, groups_per_step=args.groups_per_step,
                               group_size=args.group_size, lr=args.lr, layout=layout,
                               seed=args.seed,
                               log=lambda r, L=layout: print(L, json.dumps(r), flush=True))
    summary = {}
    for layout, curve in curves.items():
        r = [c["reward_mean"] for c in curve]
        summary[layout] = {"first5": float(np.mean(r[:5])), "last5": float(np.mean(r[-5:])),
                           "seconds": curve[-1]["seconds"]}
    names = list(curves)
    if len(names) > 1:
        a, b = (np.array([c["reward_mean"] for c in curves[n]]) for n in names[:2])
        summary["max_reward_diff"] = float(np.abs(a - b).max())
    print(json.dumps(summary))
    if args.json:
        from treeflow.atomic import atomic_open

        with atomic_open(args.json, "w") as f:
            json.dump({"summary": summary, "curves": curves}, f, indent=1)
    if args.plot:
        plot(curves, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
