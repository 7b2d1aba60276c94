"""Mixed precision: float32 master weights and AdamW state with bfloat16 compute (autocast, CPU)."""

import pytest
import torch

from tests.train.test_training import bins_for, episodes, small_model
from treeflow.stages import EpisodeSchedule, Forward, Loss, Reduce
from treeflow.train import Trainer


def one_step(precision, lr, dtype="bfloat16"):
    eps = episodes(seed=4)
    model = small_model() if precision == "mixed" else small_model().to(torch.bfloat16)
    tr = Trainer(Forward(dtype=dtype), Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=lr)),
                 model=model, precision=precision)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    row = tr.train_step(eps, bins_for(eps, "tree", 4096)).to_pylist()[0]
    return tr, before, row


def test_mixed_keeps_float32_weights_and_adamw_state_and_computes_in_bfloat16():
    tr, before, row = one_step("mixed", 1e-3)
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())
    state = [v for st in tr.optimizer.state.values() for v in st.values()
             if torch.is_tensor(v) and v.is_floating_point() and v.dim()]
    assert state and all(v.dtype == torch.float32 for v in state)
    # compute really ran in bfloat16: the loss differs from float32's by bf16 rounding, not more
    f32, _, row32 = one_step("mixed", 1e-3, dtype="float32")
    assert row["loss"] != row32["loss"]
    assert row["loss"] == pytest.approx(row32["loss"], rel=2e-2)
    # and the logprob phase runs in the same compute dtype
    eps = episodes(seed=4)
    lp = tr.logprobs(bins_for(eps, "tree", 4096)).column("edge_logprobs").combine_chunks()
    lp32 = f32.logprobs(bins_for(eps, "tree", 4096)).column("edge_logprobs").combine_chunks()
    assert lp.flatten().to_pylist() != pytest.approx(lp32.flatten().to_pylist(), abs=1e-6)


def test_small_updates_survive_in_mixed_and_vanish_in_pure_bfloat16():
    # AdamW's first step moves every weight by about lr; 1e-4 is below bf16's resolution of a
    # unit norm weight (2^-8 = 0.0039), so pure bf16 rounds the update away
    mixed, before_m, _ = one_step("mixed", 1e-4)
    pure, before_p, _ = one_step("pure", 1e-4)
    norm_m = mixed.model.model.norm.weight.detach()
    norm_p = pure.model.model.norm.weight.detach()
    assert pure.model.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(norm_p, before_p["model.norm.weight"])  # stalled
    moved = (norm_m - before_m["model.norm.weight"]).abs()
    assert float(moved.min()) > 0.5e-4 and float(moved.max()) < 2e-4
