"""A training step's generation KL equals the same quantity computed from a replay's logprobs.

The step accumulates k3 = exp(d) - 1 - d, d = logprob - generation_logprob, on the device
inside its bins; the reference reassembles a logprob replay of the same episodes per token and
computes it with numpy (programs/fidelity.py): two independent paths over the same tokens.
"""

import math

import numpy as np
import pyarrow as pa

from treeflow.pipeline import Pipeline
from treeflow.tools import synth_episodes
from treeflow.programs.fidelity import generation_kl
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Pack, Reassemble, Reduce
from treeflow.train import Trainer


def _with_calls(eps, change):
    calls = eps.column("calls").to_pylist()
    for cs in calls:
        for c in cs:
            change(c)
    field = eps.schema.field("calls")
    return eps.set_column(eps.schema.get_field_index("calls"), field, pa.array(calls, type=field.type))


def _mask_first_half(call):
    """Mask the first half of the sampled tokens and make their generation logprobs absurd.

    A masked token's logprob of -50 (the model's are near -log(vocab)) gives d of about +40,
    so k3 of about e^40: a step that counted a single masked token would be off by orders
    of magnitude, not by a rounding error.
    """
    n = len(call["token_ids"]) - call["sampled_start"]
    call["loss_mask"] = [i >= n // 2 for i in range(n)]
    call["generation_logprobs"] = [-50.0 if i < n // 2 else g
                                   for i, g in enumerate(call["generation_logprobs"])]


def test_step_generation_kl_matches_replay():
    eps = synth_episodes(episodes=6, group_size=3, turns=(1, 3), system_tokens=10, user_tokens=(2, 4),
                         completion_tokens=(2, 6), tool_tokens=(2, 4), seed=11)
    eps = _with_calls(eps, _mask_first_half)   # masked tokens count in neither figure
    replay = Pipeline(Pack(layout="exact"), Fragment(max_tokens=256), Forward(), Reassemble())
    want = generation_kl(eps, next(iter(replay.run(eps))).output)
    assert want["gen_tokens"] > 20 and want["gen_kl"] > 0.1   # synthetic logprobs: far off
    assert want["gen_logprob_max_diff"] < 30                  # no masked token counted
    # the mask matters here: counting the masked tokens too changes the figure by orders
    unmasked = _with_calls(eps, lambda c: c.update(loss_mask=[True] * len(c["loss_mask"])))
    assert generation_kl(unmasked, next(iter(replay.run(unmasked))).output)["gen_kl"] > 1e6 * want["gen_kl"]
    red = Reduce(loss=Loss(kind="pg"), schedule=EpisodeSchedule(lr=1e-2))
    train = Pipeline(Pack(layout="tree"), Fragment(max_tokens=64), Forward(), red)  # several bins
    rec = next(iter(train.run(eps, trainer=Trainer(Forward(), red))))
    row = rec.output.to_pylist()[0]
    assert row["bins"] > 1
    assert math.isclose(row["gen_kl"], want["gen_kl"], rel_tol=1e-5)
    assert math.isclose(row["gen_logprob_max_diff"], want["gen_logprob_max_diff"], rel_tol=1e-5)
    # no generation logprobs: no figure rather than a made-up one
    bare = _with_calls(eps, lambda c: c.update(generation_logprobs=None))
    nll = Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-2))
    row = next(iter(Pipeline(Pack(), Fragment(max_tokens=64), Forward(), nll).run(
        bare, trainer=Trainer(Forward(), nll)))).output.to_pylist()[0]
    assert row["gen_kl"] is None and row["gen_logprob_max_diff"] is None
    assert np.isfinite(row["loss"])
