"""--shard-params (FSDP2, train/fsdp.py) in a bfloat16 run keeps float32 routers float32.

FSDP2 casts what it gathers to its policy's param_dtype: one policy per decoder layer cast the
router weight to bfloat16, so under --shard-params the routers of the float32-router families
(models/moe/block.py "Router precision": router_dtype "float32", the sigmoid routers) decided from
a bf16-rounded weight, unlike the unsharded trainer and the sampler. The routers are now a
group of their own gathered in float32. Checked on two gloo processes against the float32
tensors in the checkpoint file: every router call's logits equal x @ W^T computed in float64
within 1e-6 of the largest (a float32 product of 32 terms; measured 2.3e-7, and 3.0e-3 with
the weight gathered in bf16 as before), and the weight the call reads is float32, for Qwen3-MoE
(softmax) and GLM-4.5 (sigmoid, correction bias, group-limited: its near-tie band reads the
weight again after the call), through a replayed-route training step.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.deps import require
from treeflow.train.launch import spawn

require("transformers")

pytestmark = pytest.mark.multiprocess


def _rank(path, data):
    import pyarrow.ipc as ipc
    import torch.nn.functional as F

    from treeflow.models.moe.block import float32_router_names
    from treeflow.pipeline import Pipeline
    from treeflow.stages import Forward, Fragment, Loss, Pack, Reduce, Shard
    from treeflow.train import DataParallel, Trainer

    dp = DataParallel.from_env("cpu")
    fwd = Forward(model=path, dtype="bfloat16", routing="replay")
    red = Reduce(loss=Loss(kind="nll"))
    tr = Trainer(fwd, red, dp=dp, shard_params=True)
    seen = []

    def record(name):
        def hook(module, args, out):
            w = module.weight
            seen.append((name, str(w.dtype), type(w).__name__, args[0].detach().float(),
                         out.detach()))
        return hook

    names = sorted({n.rpartition(".")[0] for n in float32_router_names(tr.model)})
    for name in names:
        tr.model.get_submodule(name).register_forward_hook(record(name))
    with ipc.open_file(data) as f:
        eps = f.read_all()
    pipe = Pipeline(Pack(), Fragment(max_tokens=512), Shard(), fwd, red)
    rows = [r.output.to_pylist()[0] for r in pipe.run(eps, episodes_per_step=len(eps),
                                                      trainer=tr)]
    dp.close()
    from safetensors.torch import load_file

    ckpt = load_file(os.path.join(path, "model.safetensors"))
    worst = 0.0
    for name, _, _, x, logits in seen:
        want = F.linear(x.double(), ckpt[f"{name}.weight"].double())
        worst = max(worst, float(((logits.double() - want).abs().max()) / want.abs().max()))
    return {"routers": names, "calls": len(seen), "worst": worst, "loss": rows[0]["loss"],
            "weights": sorted({(dtype, kind) for _, dtype, kind, _, _ in seen})}


@pytest.mark.parametrize("family", [  # GLM-4.5's router reads its weight twice a call
    "glm4_moe", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_sharded_params_keep_float32_routers_float32(family, tmp_path):
    import pyarrow as pa

    from tests.models.families_helpers import hf_deepseek
    from tests.models.moe_helpers import hf_model, with_routes
    from treeflow.tools import synth_episodes, write_episodes
    from treeflow.schemas import EPISODE_SCHEMA, validate_episodes

    hf = hf_deepseek(family) if family == "glm4_moe" else hf_model(family)
    hf.save_pretrained(tmp_path / "m")
    eps = synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=6,
                         user_tokens=(2, 5), completion_tokens=(2, 5), tool_tokens=(2, 4),
                         vocab_size=hf.config.vocab_size, seed=4)
    rows = with_routes(hf, eps.to_pylist())
    write_episodes(validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA)),
                   tmp_path / "e.arrow")
    runs = spawn(_rank, 2, str(tmp_path / "m"), str(tmp_path / "e.arrow"), timeout_s=240,
                 threads=1)
    for run in runs:
        assert run["routers"] and run["calls"] >= len(run["routers"])
        # float32 logits of the float32 weight (a bf16-rounded weight: ~1e-3)
        assert run["worst"] <= 1e-6, run
        assert run["weights"] == [("torch.float32", "Parameter")], run  # gathered, float32
        assert torch.isfinite(torch.tensor(run["loss"]))
    assert runs[0]["loss"] == runs[1]["loss"]
