"""Qwen3 dense (q/k RMSNorm per head before RoPE): treeflow = transformers call by call.

The oracle is transformers' own `Qwen3ForCausalLM`, run on one call at a time in float32;
treeflow loads the checkpoint transformers saved and runs the same GRPO-group episodes
through Pack (tree with group sharing, chain, exact), Fragment (a budget that cuts trees)
and Forward, then a training step; random forests with forks run through every tree
kernel against each root-to-node path through transformers. Norms (q_norm and k_norm
included) are drawn far from 1, so a skipped or misplaced q/k norm cannot hide.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch
from models_helpers import hf_call_logprobs, path_to, random_forest, run_path, tree_tensors

from tests.models.families_helpers import VOCAB, hf_qwen3, transformers
from tests.models.moe_helpers import episodes, hf_occurrence_logprobs, occurrence_logprobs
from treeflow.models import AttentionPlan, ModelConfig, load_model, save_model
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Pack
from treeflow.stages.fragment import fragment

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

LAYOUTS = ("tree", "chain", "exact")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers Qwen3ForCausalLM, treeflow Decoder loaded from its saved checkpoint)."""
    hf = hf_qwen3()
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return hf, load_model(path), path


@pytest.fixture(scope="module")
def rows():
    return episodes(np.random.default_rng(3))  # 2 GRPO groups of 2, 3 calls each


def _weights(keys):
    rng = np.random.default_rng(7)
    return {k: float(rng.uniform(0.5, 1.5)) for k in sorted(keys)}


def _assert_grads_close(ours, hf_grads, what):
    names = dict(ours.named_parameters())
    assert names.keys() == hf_grads.keys()
    assert {"model.layers.0.self_attn.q_norm.weight",
            "model.layers.1.self_attn.k_norm.weight"} <= names.keys()
    for n, g in hf_grads.items():
        mine = names[n].grad
        assert mine is not None, n
        scale = float(g.abs().max())
        assert scale > 0, n
        assert float((mine - g).abs().max()) <= 1e-5 * scale, (what, n)


def test_config_reads_and_writes_qwen3(pair):
    hf, ours, path = pair
    c = ours.config
    assert (c.architecture, c.qk_norm, c.head_dim, c.moe) == ("Qwen3ForCausalLM", True, 16, None)
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    with pytest.raises(ValueError, match=r"qk_norm=False.*Qwen3ForCausalLM"):
        ModelConfig(**{**{f: getattr(c, f) for f in ("vocab_size", "hidden_size",
                                                     "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads",
                                                     "num_key_value_heads")},
                       "architecture": "Qwen3ForCausalLM", "qk_norm": False})
    d = json.loads((path / "config.json").read_text())
    for key, value, what in [("attention_bias", True, "attention_bias=true"),
                             ("use_sliding_window", True, "use_sliding_window=true"),
                             ("layer_types", ["sliding_attention", "full_attention"],
                              "layer_types"),
                             ("rope_parameters", {"rope_type": "yarn", "factor": 4.0,
                                                  "rope_theta": 1e6}, "rope_parameters.rope_type=.yarn.")]:
        with pytest.raises(ValueError, match=rf"Qwen3ForCausalLM config uses {what}"):
            ModelConfig.from_hf_dict({**d, key: value})


@pytest.mark.parametrize("max_tokens", [24, 4096])
def test_logprobs_and_gradients_match_transformers(pair, rows, max_tokens):
    """Every sampled token's logprob and every parameter gradient of a weighted sum of them:
    tree (the groups' prompts shared), chain and exact, cut into fragments by a 24-token
    budget or whole, = transformers call by call (1e-5 absolute on logprobs, 1e-5 of each
    tensor's largest entry on gradients: float32 sums in another order)."""
    hf, ours, _ = pair
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, rows, replay=False)
    w = _weights(want)
    hf.zero_grad()
    sum(w[k] * v for k, v in hf_occurrence_logprobs(hf, rows, replay=False).items()).backward()
    hf_grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    shared = 0
    for layout in LAYOUTS:
        ours.zero_grad()
        got, _, bins = occurrence_logprobs(ours, rows, layout=layout, routing="auto",
                                           max_tokens=max_tokens, kernel="dense")
        assert got.keys() == want.keys()
        diff = max(abs(float(got[k].detach()) - float(want[k])) for k in want)
        assert diff < 1e-5, (layout, max_tokens, diff)
        sum(w[k] * v for k, v in got.items()).backward()
        _assert_grads_close(ours, hf_grads, (layout, max_tokens))
        tokens = sum(len(p) for p in bins.column("positions").to_pylist())
        shared = tokens if layout == "tree" else shared
        if layout == "exact":
            assert shared < tokens  # the tree really shared the groups' prompts
        if max_tokens == 24 and layout == "tree":
            assert bins.num_rows > 2  # the budget really cut trees into fragments


@pytest.mark.parametrize("kernel", ["dense", "runs", "flex"])
def test_random_forks_match_each_path_through_transformers(pair, kernel):
    """A random forest (forks at random depths) through each tree kernel: every node's hidden
    state's next-token logprobs = transformers on the node's root path alone."""
    hf, ours, _ = pair
    tokens, parents = random_forest(np.random.default_rng(11), 48, vocab=VOCAB, extend=0.6)
    toks, pos, end = tree_tensors(tokens, parents)
    assert (pos.numpy() != np.arange(len(pos))).sum() > len(pos) // 2  # really branching
    plan = AttentionPlan(end, kernel=kernel, parents_N=parents if kernel == "runs" else None)
    with torch.no_grad():
        got = torch.log_softmax(ours.project(ours(toks, pos, plan)), -1)
        for node in range(len(tokens)):
            path = path_to(parents, node)
            want = torch.log_softmax(hf(torch.as_tensor(tokens[path])[None]).logits[0, -1], -1)
            torch.testing.assert_close(got[node], want, atol=1e-5, rtol=0)


def test_training_step_equals_transformers_and_saves_back(pair, rows, tmp_path):
    """A Trainer step (token-mean NLL over fragments of the tree layout): its loss and every
    float64-summed gradient = the hand formula on transformers call by call; after an
    optimizer step the saved checkpoint loads in transformers and gives treeflow's logprobs."""
    from treeflow.stages import Loss, Reduce
    from treeflow.train import Trainer

    hf, _, path = pair
    ours = load_model(path)  # a fresh copy: the step changes its weights
    hf.zero_grad()
    nll, n_tok = 0.0, 0
    for row in rows:
        for c in row["calls"]:
            t = torch.as_tensor([c["token_ids"]])
            logp = torch.log_softmax(hf(t).logits[0][c["sampled_start"] - 1:-1], -1)
            nll = nll - logp.gather(-1, t[0, c["sampled_start"]:, None]).sum()
            n_tok += t.shape[1] - c["sampled_start"]
    want = nll / n_tok
    want.backward()
    trainer = Trainer(Forward(kernel="dense"), Reduce(loss=Loss(kind="nll")), model=ours,
                      grad_sum="float64")
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    step = trainer.open_step(table)
    step.add(fragment(Pack(layout="tree")(table), max_tokens=40))
    assert abs(step.loss_sum - float(want.detach())) < 1e-5 * abs(float(want.detach()))
    for n, p in hf.named_parameters():
        g, mine = p.grad.double(), step._grad64[n]
        assert float((mine - g).abs().max()) <= 1e-5 * float(g.abs().max()), n
    step.finish()
    assert not torch.equal(ours.model.layers[0].self_attn.q_norm.weight,
                           load_model(path).model.layers[0].self_attn.q_norm.weight)
    save_model(ours, tmp_path / "after")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "after").eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    seq = rows[0]["calls"][-1]["token_ids"]
    with torch.no_grad():
        mine = torch.log_softmax(ours.project(run_path(ours, np.asarray(seq),
                                                       list(range(len(seq))))), -1)
        theirs = torch.log_softmax(back(torch.as_tensor([seq])).logits[0], -1)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_cli_replay_and_train_on_a_qwen3_checkpoint(pair, tmp_path, capsys):
    """`treeflow replay --model DIR` as README says: logprobs = transformers call by call;
    `--mode train --save` writes a checkpoint transformers loads as Qwen3ForCausalLM."""
    from treeflow.cli import main
    from treeflow.pipeline import synth_episodes, write_episodes

    hf, _, path = pair
    eps = synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=10,
                         user_tokens=(2, 5), completion_tokens=(2, 6), tool_tokens=(2, 5),
                         branch_prob=0.3, vocab_size=VOCAB, seed=2)
    write_episodes(eps, tmp_path / "e.arrow")
    out = tmp_path / "lp.arrow"
    assert main(["replay", str(tmp_path / "e.arrow"), "--model", str(path), "--layout", "tree",
                 "--max-tokens", "48", "--quiet", "-o", str(out)]) == 0
    got = np.concatenate([np.concatenate(r["logprobs"]) for r in
                          pa.ipc.open_file(out).read_all().to_pylist()])
    want = hf_call_logprobs(hf, eps)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-5
    assert main(["replay", str(tmp_path / "e.arrow"), "--model", str(path), "--mode", "train",
                 "--episodes-per-step", "2", "--steps", "1", "--loss", "nll",
                 "--max-tokens", "48", "--save", str(tmp_path / "ckpt"), "--quiet"]) == 0
    capsys.readouterr()
    saved = next(p.parent for p in (tmp_path / "ckpt").rglob("config.json"))
    back = transformers.AutoModelForCausalLM.from_pretrained(saved)
    assert type(back).__name__ == "Qwen3ForCausalLM"
    assert load_model(saved).config.qk_norm
