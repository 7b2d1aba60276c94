"""The speed/memory levers (models/tuning.py) compute what the plain path computes, on CPU.

Each lever is checked against the plain path on the same inputs (float32) and
against an independent reference (each root-to-leaf path run alone, or the
full-vocabulary log-softmax); where a lever cannot run here (inductor on CPU)
it must warn and give the plain path's numbers.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from models_helpers import (SMALL, leaves, path_to, random_forest, run_path, small_model,
                            tree_tensors)
from torch.utils._python_dispatch import TorchDispatchMode

from treeflow.models import (AttentionPlan, ReferenceBackend, Tuning, load_model,
                             selected_logprobs)
from treeflow.models.compile.layer_ops import layer_ops
from treeflow.stages import Forward
from treeflow.ops import build_forward

# ---------------------------------------------------------------- configuration


def test_tuning_validates_and_parses():
    t = Tuning.parse("compile_layers=1,fused_loss=true,recompute=mlp,flex_block_size=64,"
                     "flex.BLOCK_M=64,flex.bwd_num_warps=8,flex.USE_TMA=true")
    assert t == Tuning(compile_layers=True, fused_loss=True, recompute="mlp", flex_block_size=64,
                       flex_kernel_options={"BLOCK_M": 64, "bwd_num_warps": 8,
                                            "USE_TMA": True})
    assert t.kernel_options == {"BLOCK_M": 64, "USE_TMA": True, "bwd_num_warps": 8}
    assert Tuning().kernel_options is None and hash(t) == hash(dataclasses.replace(t))
    # Triton's pipeline depth is any count (3 is Hopper's flex default); warps and tiles are not
    assert Tuning(flex_kernel_options={"bwd_num_stages": 3}).kernel_options == {"bwd_num_stages": 3}
    bad = [({"flex_block_size": 96}, "power of two"),
           ({"flex_kernel_options": {"BLOCK_Q": 64}}, "not a FlexAttention kernel option"),
           ({"flex_kernel_options": {"BLOCK_M": 256}}, "divide the mask tile"),
           ({"flex_kernel_options": {"num_warps": 3}}, "power of two"),
           ({"flex_kernel_options": {"bwd_num_stages": 0}}, "int >= 1"),
           ({"flex_kernel_options": {"ROWS_GUARANTEED_SAFE": True}}, "not allowed for tree masks"),
           ({"flex_kernel_options": {"fwd_ROWS_GUARANTEED_SAFE": True}}, "becomes NaN"),
           ({"flex_kernel_options": {"PRESCALE_QK": 1}}, "True or False"),
           ({"flex_kernel_options": {"bwd_BLOCK_N1": 32, "bwd_BLOCK_M1": 64}}, "multiple of BLOCK_M1"),
           ({"recompute": "all"}, "choose one of"), ({"compile_backend": "cudagraphs"}, "choose one"),
           ({"loss_vocab_chunk": 0}, ">= 1"), ({"fused_loss": 1}, "True or False")]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            Tuning(**kwargs)
    with pytest.raises(ValueError, match="is not a setting"):
        Tuning.parse("fused=1")
    with pytest.raises(ValueError, match="start with a preset"):
        Tuning.parse("fastest")


def test_presets_are_the_measured_levers_and_settings_after_them_override():
    from treeflow.models.tuning import PRESETS

    fast = Tuning.parse("fast")
    assert fast.compile_layers and fast.fused_loss and fast.recompute == "none"
    assert fast.kernel_options["bwd_BLOCK_M1"] == 64 and fast.kernel_options["bwd_num_stages"] == 3
    assert Tuning.parse("fast,recompute=mlp") == PRESETS["lean"]
    assert Tuning.parse("fast,compile_layers=0,flex.bwd_num_warps=8") == Tuning(
        fused_loss=True, flex_kernel_options={**fast.kernel_options, "bwd_num_warps": 8})
    assert Tuning.parse("plain") == Tuning() == Tuning.parse("")
    with pytest.raises(ValueError, match="own kernels"):
        Forward(backend="megatron", tuning=Tuning(fused_loss=True))


def test_auto_is_resolved_for_the_device_and_the_model_directory(tmp_path):
    """resolve_auto: plain on CPU (saying why), explicit text as given; a Mamba-2 hybrid's
    directory (by architecture or model_type) is one, a Llama's, a missing config and `tiny` not."""
    import json

    from treeflow.models.config.hybrid import is_hybrid_dir
    from treeflow.models.tuning import resolve_auto

    assert resolve_auto("auto,recompute=mlp", device="cpu", model="tiny") == (
        "plain,recompute=mlp", "on cpu the levers do not pay")
    assert resolve_auto("fast", device="cuda", model="tiny") == ("fast", None)
    assert resolve_auto("", device="cpu", model="tiny") == ("plain", None)
    for name, config, hybrid in (("nh", {"architectures": ["NemotronHForCausalLM"]}, True),
                                 ("bamba", {"model_type": "bamba"}, True),
                                 ("llama", {"architectures": ["LlamaForCausalLM"]}, False),
                                 ("list", [1, 2], False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert is_hybrid_dir(tmp_path / name) is hybrid, name
    assert not is_hybrid_dir(tmp_path / "none") and not is_hybrid_dir("tiny")


def test_forward_binds_its_tuning_to_the_reference_backend():
    tuning = Tuning(fused_loss=True, loss_vocab_chunk=10)
    runner = build_forward(Forward(tuning=tuning), model=load_model(SMALL))
    assert runner.backend.tuning == tuning
    tuned = ReferenceBackend(load_model(SMALL), tuning=Tuning(recompute="mlp"))
    with pytest.raises(ValueError, match="set the tuning in one place"):
        build_forward(Forward(tuning=tuning), model=tuned)
    assert build_forward(Forward(), model=tuned).backend.tuning.recompute == "mlp"


# ------------------------------------------------------------------- fused loss

def _loss_values(model, hidden_EH, targets_E, weights, **kwargs):
    hidden_EH = hidden_EH.detach().requires_grad_()
    model.zero_grad()
    lp, ent = selected_logprobs(model, hidden_EH, targets_E, with_entropy=True, **kwargs)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    head = model.output_weight_VH
    return lp.detach(), ent.detach(), hidden_EH.grad, head.grad.clone()


@pytest.mark.parametrize("vocab,tied,chunk,vocab_chunk", [
    (97, False, 3, 10), (97, True, 1024, 4096), (5000, True, 7, 512), (5000, False, 64, 1)])
def test_fused_loss_equals_chunked_path_and_full_log_softmax(vocab, tied, chunk, vocab_chunk):
    config = dataclasses.replace(SMALL, vocab_size=vocab, tie_word_embeddings=tied)
    model = load_model(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)  # logits spread over tens of nats
    gen = torch.Generator().manual_seed(vocab + chunk)
    hidden_EH = torch.randn(40, SMALL.hidden_size, generator=gen)
    targets_E = torch.randint(0, vocab, (40,), generator=gen)
    weights = torch.randn(2, 40, generator=gen)
    plain = _loss_values(model, hidden_EH, targets_E, weights, chunk_size=chunk)
    fused = _loss_values(model, hidden_EH, targets_E, weights, chunk_size=chunk, fused=True,
                         vocab_chunk=vocab_chunk)
    if vocab_chunk >= vocab:  # one vocabulary chunk: the plain path's arithmetic exactly
        assert torch.equal(fused[0], plain[0])
    torch.testing.assert_close(fused[0], plain[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(fused[1], plain[1], atol=1e-5, rtol=1e-5)
    for got, want in zip(fused[2:], plain[2:]):
        assert float(want.abs().max()) > 0.1
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # the independent reference: one full-vocabulary log-softmax in float64
    with torch.no_grad():
        logp_EV = torch.log_softmax(model.project(hidden_EH).double(), -1)
    np.testing.assert_allclose(fused[0].double(), logp_EV[torch.arange(40), targets_E], atol=2e-6)
    np.testing.assert_allclose(fused[1].double(), -(logp_EV.exp() * logp_EV).sum(-1), atol=2e-5)


def test_fused_loss_gradient_of_entropy_alone_and_of_logprobs_alone():
    """Each output's gradient on its own (the other's is None) against float64 autograd."""
    from treeflow.models.heads.fused_loss import fused_selected_logprobs

    gen = torch.Generator().manual_seed(3)
    hidden_EH = torch.randn(9, 16, generator=gen)
    weight_VH = 2 * torch.randn(300, 16, generator=gen)
    targets_E = torch.randint(0, 300, (9,), generator=gen)
    coef_E = torch.randn(9, generator=gen)
    for pick in (0, 1):
        h, w = hidden_EH.clone().requires_grad_(), weight_VH.clone().requires_grad_()
        out = fused_selected_logprobs(w, h, targets_E, row_chunk=4, vocab_chunk=64,
                                      with_entropy=True)[pick]
        (out * coef_E).sum().backward()
        h64, w64 = hidden_EH.double().requires_grad_(), weight_VH.double().requires_grad_()
        logp_EV = torch.log_softmax(h64 @ w64.T, -1)
        want = logp_EV[torch.arange(9), targets_E] if pick == 0 else -(logp_EV.exp() * logp_EV).sum(-1)
        (want * coef_E.double()).sum().backward()
        for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
            scale = float(ref.abs().max())  # float32 against float64: relative to the largest entry
            assert scale > 0.5 and float((got.double() - ref).abs().max()) <= 1e-5 * scale


class _LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_fused_loss_never_holds_rows_x_vocabulary_float32_logits():
    vocab, rows, chunk, vocab_chunk = 4000, 64, 16, 500
    model = load_model(dataclasses.replace(SMALL, vocab_size=vocab), dtype=torch.bfloat16)
    hidden_EH = torch.randn(rows, SMALL.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    targets_E = torch.randint(0, vocab, (rows,))
    for fused, bound in ((False, chunk * vocab), (True, chunk * vocab_chunk)):
        with _LargestFloat32() as seen:
            lp, ent = selected_logprobs(model, hidden_EH, targets_E, chunk_size=chunk,
                                        with_entropy=True, fused=fused, vocab_chunk=vocab_chunk)
            (lp.sum() + ent.sum()).backward()
        assert seen.largest == bound  # the plain path's chunk x vocabulary tile; the fused one's


def test_fused_loss_refuses_a_sharded_weight():
    from treeflow.models.heads.fused_loss import fused_selected_logprobs

    class Sharded(torch.Tensor):
        pass

    w = torch.zeros(5, 4).as_subclass(Sharded)
    with pytest.raises(ValueError, match="shard-params"):
        fused_selected_logprobs(w, torch.zeros(2, 4), torch.zeros(2, dtype=torch.long),
                                row_chunk=2, vocab_chunk=2, with_entropy=False)


# ----------------------------------------------------- compiled and recomputed layers

def _tree():
    tokens, parents = random_forest(np.random.default_rng(7), 60, extend=0.6)
    return tokens, parents, *tree_tensors(tokens, parents)


def _hidden_and_grads(model, tuning, kernel="runs", grad=True):
    tokens, parents, toks, pos, end = _tree()
    plan = AttentionPlan(end, kernel=kernel, parents_N=parents)
    model.zero_grad()
    with torch.set_grad_enabled(grad):
        hidden = model(toks, pos, plan, tuning)
        if grad:
            (hidden * torch.linspace(-1, 1, hidden.numel()).view(hidden.shape)).sum().backward()
    return hidden.detach(), ({n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None} if grad else {})


@pytest.mark.parametrize("tuning", [
    Tuning(recompute="mlp"), Tuning(recompute="attention"), Tuning(recompute="full"),
    Tuning(compile_layers=True, compile_backend="aot_eager"),
    Tuning(compile_layers=True, compile_backend="aot_eager", recompute="mlp")],
    ids=["recompute-mlp", "recompute-attention", "recompute-layer", "compiled", "compiled+mlp"])
def test_layer_levers_give_the_plain_hidden_states_and_gradients(tuning):
    model = small_model()
    want_h, want_g = _hidden_and_grads(model, None)
    got_h, got_g = _hidden_and_grads(model, tuning)
    if not tuning.compile_layers:  # recomputation replays the same operations
        assert torch.equal(got_h, want_h)
    torch.testing.assert_close(got_h, want_h, atol=1e-6, rtol=1e-6)
    for name in want_g:
        scale = float(want_g[name].abs().max())
        assert scale > 0, name
        assert float((got_g[name] - want_g[name]).abs().max()) <= 1e-5 * scale, name
    # and the independent reference: every root-to-leaf path run alone
    tokens, parents, *_ = _tree()
    with torch.no_grad():
        for leaf in leaves(parents)[:5]:
            path = path_to(parents, leaf)
            torch.testing.assert_close(got_h[path], run_path(model, tokens, path), atol=1e-5, rtol=0)


_SHARE_PROBE = """
import numpy as np, torch
from torch._dynamo.utils import counters
from models_helpers import random_forest, small_model, tree_tensors
from treeflow.models import AttentionPlan, Tuning
model = small_model()
tuning = Tuning(compile_layers=True, compile_backend="aot_eager")
for n in (30, 41, 52):
    toks, pos, end = tree_tensors(*random_forest(np.random.default_rng(n), n))
    with torch.no_grad():
        model(toks, pos, AttentionPlan(end, kernel="dense"), tuning)
print(counters["stats"]["unique_graphs"])
"""


def test_compiled_layers_share_one_graph_per_part_across_layers_and_lengths(tmp_path):
    """Counted in a fresh process (compile cache off, as a process that never configured one):
    dynamo's graph count is process-global, and in a test worker graphs that earlier tests
    captured (compile cache, precompiled variants) were served without a trace (CI read 0)."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, root]),
           "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _SHARE_PROBE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # attention inputs, then o_proj through the MLP: not per layer, part or length
    assert int(out.stdout.split()[-1]) == 2, out.stdout + out.stderr[-2000:]


def test_inductor_on_cpu_warns_and_runs_the_plain_path():
    import treeflow.models.compile.layer_ops as lo

    lo._warn_eager.cache_clear()
    model = small_model()
    want_h, want_g = _hidden_and_grads(model, None)
    with pytest.warns(UserWarning, match="CUDA only"):
        got_h, got_g = _hidden_and_grads(model, Tuning(compile_layers=True))
    assert torch.equal(got_h, want_h) and all(torch.equal(got_g[n], want_g[n]) for n in want_g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per device type, not per call
        assert layer_ops(Tuning(compile_layers=True), torch.device("cpu")) is None


# ----------------------------------------------------------------- flex options

def test_flex_tiles_and_kernel_options_keep_the_tree_attention():
    model = small_model()
    tokens, parents = random_forest(np.random.default_rng(1), 150)
    toks, pos, end = tree_tensors(tokens, parents)
    with torch.no_grad():
        dense = model(toks, pos, AttentionPlan(end, kernel="dense"))
        for tuning in (Tuning(flex_block_size=16),
                       Tuning(flex_block_size=64, flex_kernel_options={
                           "BLOCK_M": 64, "BLOCK_N": 32})):
            backend = ReferenceBackend(model, tuning=tuning)
            plan = backend.attention_plan(parents, end, kernel="flex")
            assert plan._mask.block_mask.BLOCK_SIZE == (tuning.flex_block_size,) * 2
            torch.testing.assert_close(backend.hidden_states(toks, pos, plan), dense, atol=2e-5,
                                       rtol=0)

