"""Policy (the in-process API) gives what the command line gives on the same episodes.

For a dense model, an MoE with routing replay and a Mamba-2 hybrid, each saved by
transformers itself: `Policy(DIR).logprobs` and `Policy(hf_module).logprobs` equal `treeflow
replay`'s output file, and the weights after `Policy(DIR).train_step` equal the checkpoint
`replay --mode train --steps 1 --save` writes. The independent checks (transformers call by
call) are in test_policy.py; this file pins the API to the CLI's path (same planner, kernels,
routing replay, Hybrid forks), so a Policy that planned, routed or normalised differently fails.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from tests.deps import require
from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes
from treeflow.tools.synth import routes_like
from treeflow.stages import EpisodeSchedule, Forward, Fragment, Loss, Reduce
from treeflow.train import Policy

transformers = require("transformers")

MAX_TOKENS = 40  # small: the longer trees are cut into fragments
FLAGS = ["--max-tokens", str(MAX_TOKENS), "--lr", "1e-2", "--loss", "pg", "--norm", "seq-mean"]


def _dense():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _moe():
    from tests.models.moe_helpers import hf_model

    return hf_model("qwen3_moe").eval()


def _hybrid():
    from tests.models.hybrid_helpers import hf_model

    return hf_model("nemotron_h").eval()


@pytest.fixture(scope="module", params=["dense", "moe", "hybrid"])
def family(request, tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp(f"policy_{request.param}")
    hf = {"dense": _dense, "moe": _moe, "hybrid": _hybrid}[request.param]()
    hf.save_pretrained(tmp / "model")
    routes = routes_like(str(tmp / "model")) if request.param == "moe" else {}
    # synthetic (hashed) routes of the model's shape, replayed by both sides
    eps = synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=10,
                         user_tokens=(2, 5), completion_tokens=(2, 6), tool_tokens=(2, 5),
                         vocab_size=61, seed=3, **routes)
    eps = eps.set_column(eps.column_names.index("advantage"), "advantage",
                         pa.array([1.0, -0.5, 0.25, -1.0], pa.float32()))
    write_episodes(eps, tmp / "e.arrow")
    yield request.param, tmp, hf, eps
    torch.set_num_threads(n)


def _forward(name):
    return Forward(routing="replay") if name == "moe" else Forward()


def test_logprobs_equal_replay(family, capsys):
    name, tmp, hf, eps = family
    routing = ["--routing", "replay"] if name == "moe" else []
    assert main(["replay", str(tmp / "e.arrow"), "--model", str(tmp / "model"), "--quiet",
                 "--max-tokens", str(MAX_TOKENS), "--entropy", "-o", str(tmp / "lp.arrow"),
                 *routing]) == 0
    cli = pa.ipc.open_file(tmp / "lp.arrow").read_all()
    frag = Fragment(max_tokens=MAX_TOKENS)
    for model in (str(tmp / "model"), hf):
        got = Policy(model, fragment=frag, forward=_forward(name)).logprobs(eps, entropy=True)
        assert got.column("episode_id").to_pylist() == cli.column("episode_id").to_pylist()
        for col in ("logprobs", "entropies"):
            a = np.concatenate([np.concatenate(c) for c in got.column(col).to_pylist()])
            b = np.concatenate([np.concatenate(c) for c in cli.column(col).to_pylist()])
            # the same bins through the same kernels: equal up to the float32 summation order
            # of the adopted module (same values, another Parameter object)
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=f"{name} {col}")


def test_train_step_equals_replay_train(family, capsys):
    name, tmp, hf, eps = family
    routing = ["--routing", "replay"] if name == "moe" else []
    assert main(["replay", str(tmp / "e.arrow"), "--model", str(tmp / "model"), "--mode", "train",
                 "--steps", "1", "--episodes-per-step", "4", "--save", str(tmp / "ckpt"),
                 "--quiet", *FLAGS, *routing]) == 0
    want = load_file(tmp / "ckpt" / "step-000001" / "model.safetensors")
    before = load_file(tmp / "model" / "model.safetensors")
    policy = Policy(str(tmp / "model"), fragment=Fragment(max_tokens=MAX_TOKENS),
                    forward=_forward(name),
                    reduce=Reduce(loss=Loss(kind="pg", norm="seq-mean"),
                                  schedule=EpisodeSchedule(lr=1e-2)))
    row = policy.train_step(eps)
    assert row["episodes"] == 4 and row["step"] == 1
    got = {k: v.detach() for k, v in policy.backend.module.state_dict().items()}
    moved = 0
    for key, w in want.items():
        mine = got.get(key)
        if mine is None:  # an expert stored one matrix per expert on disk, fused in memory
            continue
        assert torch.allclose(mine, w, rtol=0, atol=1e-6), key
        moved += int(not torch.equal(w, before[key]))
    assert moved > 0  # the step changed the weights (lr 1e-2)
