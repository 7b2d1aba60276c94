"""Mixed precision on CPU: the megatron backend's training step against the reference backend's.

Mixed precision is float32 master weights and AdamW with bfloat16 compute under
autocast (train/precision.py), the Trainer's default with `--dtype bfloat16`.
A GPU run once reported the megatron backend's gradient norm at 2.1x the
float32 reference's; the cause was the check's loss (old logprobs far from the
policy's made the gradient hang on a handful of tokens, see
megatron_tp_worker._step), but a real defect (gradients counted twice, a cast
that loses the float32 master gradient, a weight left out of autocast) would
show the same way. So on an on-policy PG step, per parameter (MCore names, tied
Qwen2 with QKV bias and untied Llama): the gradient stays float32, its norm is
within 5% of the float32 reference's, and its largest deviation from float32
is at most three times the reference backend's own mixed-precision deviation
(the bf16 noise bound; measured: 0.015 vs 0.020 for Llama, 0.020 vs 0.011 for
Qwen2; MCore applies RoPE in bfloat16, casting cos/sin to q's dtype, where the
reference computes it in float32 and rounds once, so its q and k are
noisier). A 1.5x error on one norm weight's gradient fails it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                    "pip install 'treeflow[megatron]' to run the megatron backend tests")

from megatron_tp_worker import _episodes, _norm_ratio, _rel_err, _step  # noqa: E402
from test_megatron_tp import write_checkpoint  # noqa: E402

from treeflow.models import load_backend  # noqa: E402
from treeflow.models.megatron import hf_to_mcore  # noqa: E402
from treeflow.stages import Forward, Fragment, Loss, Pack, Reassemble  # noqa: E402
from treeflow.ops import build_forward


# each test tears down the group the backend makes (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("megatron_group")


@pytest.mark.parametrize("qwen", [False, True], ids=["llama", "qwen2"])
def test_mixed_precision_step_is_within_the_reference_backends_bf16_noise(tmp_path, qwen):
    path = write_checkpoint(tmp_path / "m", qwen=qwen)
    eps = _episodes(256, 200)
    eps = eps.set_column(eps.schema.get_field_index("advantage"), "advantage",
                         pa.array(np.linspace(-1, 1, eps.num_rows), pa.float32()))
    bins = Fragment(max_tokens=128)(Pack(layout="tree")(eps))
    loss = Loss(kind="pg", norm="seq-mean", clip_low=0.2, clip_high=0.28)
    args = SimpleNamespace(train_kernel="auto", device="cpu")
    ref = load_backend("reference", path)
    with torch.no_grad():
        old = Reassemble()(build_forward(Forward(model=path, chunk_size=64), model=ref.module)(bins),
                           episodes=eps)

    def run(name, dtype):
        backend = load_backend(name, path)  # float32 weights: the master copy
        _, norm, grads, _ = _step(backend, path, dtype, eps, bins, loss, args, old=old,
                                  finish=False)
        assert all(p.dtype == torch.float32 for _, p in backend.named_parameters())
        assert all(g.dtype == torch.float32 for g in grads.values())
        return norm, (grads if name == "megatron" else hf_to_mcore(grads, backend.config))

    ref32_norm, ref32 = run("reference", "float32")
    mixed_norm, mixed = run("reference", "bfloat16")
    meg_norm, meg = run("megatron", "bfloat16")
    noise = _rel_err(mixed, ref32)
    err, ratio = _rel_err(meg, ref32), _norm_ratio(meg, ref32)
    assert 0 < max(noise.values()) < 0.2  # bf16 did change the gradients, by noise only
    assert meg_norm == pytest.approx(ref32_norm, rel=0.05), (meg_norm, mixed_norm, ref32_norm)
    bad = {n: (ratio[n], err[n], noise[n]) for n in ref32
           if not (0.95 <= ratio[n] <= 1.05 and err[n] <= 3 * max(noise.values()))}
    assert not bad, bad
