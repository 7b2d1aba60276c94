"""examples/trl_grpo.py on two processes (accelerate's MULTI_CPU over gloo): the recipe's
gradients, averaged by its training_step, equal TRL's own computation through a
DistributedDataParallel forward (DDP's all-reduce) on each rank's own rows.

Without the recipe's averaging each rank keeps its own gradients (treeflow's forward does not
run DDP.forward, which arms DDP's hooks); the test checks that too, so the averaging is not
vacuous.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from tests.deps import require
from treeflow.train.launch import spawn

require("trl")
transformers = require("transformers")
datasets = require("datasets")

pytestmark = pytest.mark.multiprocess


def _rank():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from examples.trl_grpo import TreeflowGRPOTrainer
    from tests.io.conftest import build_tokenizer
    from treeflow.stages import Fragment
    from trl import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        tok = transformers.AutoTokenizer.from_pretrained(build_tokenizer(tmp))
        tok.padding_side = "left"
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(4.0)
        args = GRPOConfig(output_dir=tmp, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=1, use_cpu=True, report_to=[],
                          save_strategy="no", temperature=1.0, bf16=False)
        tr = TreeflowGRPOTrainer(
            model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["List."] * 8}),
            processing_class=tok, treeflow_fragment=Fragment(max_tokens=24))
        assert tr.accelerator.num_processes == 2 and dist.get_world_size() == 2
        rank = dist.get_rank()
        rng = np.random.default_rng(10 + rank)  # each rank its own rows
        P, C = 6, 8
        ids = torch.tensor(rng.integers(1, 300, (3, P + C)))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # a left-padded prompt
        mask[1, P + 5:] = 0  # a short completion
        ddp = DistributedDataParallel(model)
        out = {}
        for name, fn in (("trl", GRPOTrainer._get_per_token_logps_and_entropies),
                         ("treeflow", TreeflowGRPOTrainer._get_per_token_logps_and_entropies)):
            model.zero_grad(set_to_none=True)
            logps, _, _ = fn(tr, ddp, ids, mask, C)
            comp = mask[:, -C:].bool()
            (logps[comp] * torch.linspace(-1, 1, int(comp.sum()))).sum().backward()
            if name == "treeflow":
                out["local"] = {n: p.grad.clone() for n, p in model.named_parameters()}
                tr._average_gradients(ddp)
            out[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
        return out


def test_recipe_averages_gradients_as_ddp_does():
    results = spawn(_rank, 2, timeout_s=300, threads=1)
    for out in results:
        trl, ours, local = out["trl"], out["treeflow"], out["local"]
        for n in trl:  # float32 forwards in two layouts, as in test_trl_recipe.py
            scale = float(trl[n].abs().max())
            assert float((ours[n] - trl[n]).abs().max()) <= 1e-4 * scale + 1e-7, n
        worst = max(float((local[n] - trl[n]).abs().max() / trl[n].abs().max()) for n in trl)
        assert worst > 1e-2  # one rank's own gradients are not the mean
