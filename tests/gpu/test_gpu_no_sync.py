"""On CUDA, nothing between the first and the last bin of a batch makes the host wait.

torch's sync debug mode turns every operation that waits for the device
(`.item()`, `.tolist()`, `nonzero`, a blocking copy) into an error ("error")
or a warning ("warn"); preparing and launching replay bins must raise none,
and a training step may wait per bin only as often as the model's own
forward and backward do (torch's embedding backward, for one, waits).
"""

import dataclasses
import warnings

import pytest
import torch

from treeflow.models import ModelConfig, load_model
from treeflow.tools import synth_episodes
from treeflow.stages import Forward, Fragment, Loss, Pack, Reassemble, Reduce
from treeflow.train import Trainer
from treeflow.ops import build_forward

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _eps(n=12):
    return synth_episodes(episodes=n, group_size=3, turns=(2, 4), system_tokens=64,
                          user_tokens=(8, 16), completion_tokens=(8, 24), tool_tokens=(8, 24),
                          branch_prob=0.3, vocab_size=512, seed=3)


def _model():
    return load_model(dataclasses.replace(ModelConfig.tiny(), vocab_size=512),
                      dtype=torch.float32, device="cuda")


def _deepest(eps):
    return max(len(c["token_ids"]) for r in eps.to_pylist() for c in r["calls"])


class _SyncsAreErrors:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("layout", ["tree", "exact"])  # flex bins, varlen bins
def test_replay_prepares_and_launches_without_waiting(layout):
    eps = _eps()
    budget = _deepest(eps) + 64
    runner = build_forward(Forward(), device="cuda", model=_model(), max_tokens=budget)
    bins = Fragment(max_tokens=budget)(Pack(layout=layout)(eps))
    assert bins.num_rows >= 3
    want = runner(bins)  # compiles and warms every kernel these bins use
    with _SyncsAreErrors():
        prepared = runner.prepare(bins)
        pending = runner.launch(prepared)
    got = pending.result()
    assert got.column("edge_logprobs").equals(want.column("edge_logprobs"))
    result = Reassemble()(got, episodes=eps)
    assert result.num_rows == eps.num_rows


def _syncs(fn) -> int:
    """How many times `fn()` made the host wait for the device (torch's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _step_syncs(max_tokens):
    """(bins, waits inside one add() of a step, waits of one bin's bare forward + backward)."""
    eps = _eps()
    tr = Trainer(Forward(), Reduce(loss=Loss(kind="pg", kl_coef=0.1)), model=_model(),
                 device="cuda", max_tokens=max_tokens)
    bins = Fragment(max_tokens=max_tokens)(Pack(layout="tree")(eps))
    # the reference logprobs on the same bins: the trainer pads every bin to max_tokens
    ref = Reassemble()(tr.logprobs(bins), episodes=eps)
    tr.train_step(eps, bins, ref_logprobs=ref)  # compiles flex forward and backward
    step = tr.open_step(eps, ref_logprobs=ref)
    in_step = _syncs(lambda: step.add(bins))
    step.finish()
    # the model's own backward may wait (torch's embedding backward counts its segments on the
    # host): measure one bin run bare, outside any step
    prepared = tr.runner.prepare(bins)
    tr.runner.wait_ready(prepared)
    item = next(i for i in prepared.items if i is not None)

    def bare():
        with tr.compute():
            lp, _ = tr.runner.run_bin(item)
        lp.sum().backward()

    bare()
    per_bin = _syncs(bare)
    tr.model.zero_grad(set_to_none=True)
    return bins.num_rows, in_step, per_bin


def test_training_step_adds_no_wait_per_bin():
    deepest = _deepest(_eps())
    few_bins, few_syncs, _ = _step_syncs(8192)
    many_bins, many_syncs, model_per_bin = _step_syncs(deepest + 16)
    assert many_bins >= few_bins + 3
    # whatever the step waits for happens once per add(); per bin only the model's own waits
    assert many_syncs - few_syncs == (many_bins - few_bins) * model_per_bin, (
        few_bins, few_syncs, many_bins, many_syncs, model_per_bin)
