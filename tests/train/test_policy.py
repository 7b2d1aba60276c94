"""Policy on the caller's own transformers module, checked against transformers call by call.

The oracle runs every call of every episode alone through the transformers module (full
vocabulary log-softmax, float32) and writes the PPO clipped objective and a custom loss out
term by term in float64; nothing of treeflow's layout, loss or reassembly code is used there.
Gradients must land on the caller's module's parameters.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.deps import require
from treeflow.schemas import EPISODE_SCHEMA
from treeflow.stages import Fragment, Loss, Reassemble
from treeflow.train import Policy

transformers = require("transformers")


@pytest.fixture(scope="module")
def hf():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    yield transformers.LlamaForCausalLM(cfg).eval()
    torch.set_num_threads(n)


def _rows():
    """A group of two sharing a prompt, and a three-call agent episode (calls extend each
    other, one masked token, per-token advantages); plain dicts, no sample_index."""
    rng = np.random.default_rng(0)
    t = lambda n: rng.integers(1, 53, n).tolist()  # noqa: E731
    head, c1 = t(9), t(12)
    c2 = c1 + t(7)
    return [
        {"episode_id": "a", "group_id": "g", "advantage": 1.0,
         "calls": [{"token_ids": head + t(6), "sampled_start": 9,
                    "generation_logprobs": (-rng.random(6) - 1).tolist()}]},
        {"episode_id": "b", "group_id": "g", "advantage": -0.5,
         "calls": [{"token_ids": head + t(4), "sampled_start": 9,
                    "generation_logprobs": (-rng.random(4) - 1).tolist()}]},
        {"episode_id": "c", "advantage": 0.3, "calls": [
            {"token_ids": c1, "sampled_start": 8, "generation_logprobs": [-2.0] * 4,
             "loss_mask": [True, False, True, True]},
            {"token_ids": c2, "sampled_start": 15, "generation_logprobs": [-2.5] * 4,
             "advantages": [0.1, -0.2, 0.3, 0.4]}]},
    ]


def _oracle(hf, rows):
    """Per episode, per call: (logprobs, entropies) of the sampled tokens, with autograd."""
    out = []
    for row in rows:
        calls = []
        for c in row["calls"]:
            ids = torch.tensor([c["token_ids"]])
            s = c["sampled_start"]
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)[s - 1:-1]
            calls.append((logp.gather(-1, ids[0, s:, None])[:, 0],
                          -(logp.exp() * logp).sum(-1)))
        out.append(calls)
    return out


def _grads(hf):
    g = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)
    return g


def test_logprobs_and_entropies_equal_transformers(hf):
    rows = _rows()
    res = Policy(hf, fragment=Fragment(max_tokens=24)).logprobs(rows, entropy=True)
    assert res.column("episode_id").to_pylist() == ["a", "b", "c"]
    assert res.column("sample_index").to_pylist() == [0, 1, 2]  # row order, filled
    with torch.no_grad():
        want = _oracle(hf, rows)
    for got_lp, got_ent, ep in zip(res.column("logprobs").to_pylist(),
                                   res.column("entropies").to_pylist(), want):
        for lp, ent, (w_lp, w_ent) in zip(got_lp, got_ent, ep):
            # float32 forwards of two summation orders (tree vs per call): a few ulp of ~4
            np.testing.assert_allclose(lp, w_lp.numpy(), rtol=0, atol=1e-5)
            np.testing.assert_allclose(ent, w_ent.numpy(), rtol=0, atol=1e-5)


def test_pg_loss_gradients_land_on_the_callers_module(hf):
    rows = _rows()
    policy = Policy(hf, fragment=Fragment(max_tokens=24))
    loss = policy.loss(rows, loss=Loss(kind="pg", norm="seq-mean", clip_low=0.2, clip_high=0.28))
    loss.backward()
    got = _grads(hf)
    # the oracle: seq-mean over episodes with loss tokens, PPO clip, in float64
    total, per_ep = torch.zeros((), dtype=torch.float64), []
    for row, calls in zip(rows, _oracle(hf, rows)):
        terms = []
        for c, (lp, _) in zip(row["calls"], calls):
            n = len(lp)
            mask = torch.tensor(c.get("loss_mask") or [True] * n)
            adv = torch.tensor(c.get("advantages") or [row["advantage"]] * n, dtype=torch.float64)
            ratio = torch.exp(lp.double() - torch.tensor(c["generation_logprobs"]).double())
            per = torch.maximum(-ratio * adv, -ratio.clamp(0.8, 1.28) * adv)
            terms.append(per[mask])
        per_ep.append(torch.cat(terms).mean())
    total = torch.stack(per_ep).mean()
    total.backward()
    want = _grads(hf)
    assert abs(loss.item() - total.item()) < 1e-6
    assert got.keys() == want.keys() and len(got) == len(list(hf.parameters()))
    for name in want:  # float32 backward vs the float64-summed oracle: relative to the scale
        scale = float(want[name].abs().max())
        assert float((got[name].double() - want[name]).abs().max()) <= 1e-4 * scale + 1e-7, name


def test_custom_loss_sees_tokens_in_logical_order(hf):
    rows = _rows()
    policy = Policy(hf, fragment=Fragment(max_tokens=24))
    seen = {}

    def gspo_like(t):  # sequence-level ratio: mean log-ratio per episode, a few lines
        seen.update(episode=t.episode.tolist(), call=t.call.tolist(), offset=t.offset.tolist(),
                    mask=t.mask.tolist(), adv=t.advantages.tolist())
        log_ratio = t.episode_mean(t.logprobs - t.old_logprobs)
        adv = t.episode_mean(t.advantages)
        return -(torch.exp(log_ratio) * adv).mean()

    loss = policy.loss(rows, loss_fn=gspo_like)
    loss.backward()
    got = _grads(hf)
    assert seen["episode"] == [0] * 6 + [1] * 4 + [2] * 8
    assert seen["call"] == [0] * 10 + [0] * 4 + [1] * 4
    assert seen["offset"] == [*range(6), *range(4), *range(4), *range(4)]
    assert seen["mask"][10:14] == [True, False, True, True]
    np.testing.assert_allclose(seen["adv"][14:], [0.1, -0.2, 0.3, 0.4], rtol=1e-6)
    terms = []
    for row, calls in zip(rows, _oracle(hf, rows)):
        lr, adv = [], []
        for c, (lp, _) in zip(row["calls"], calls):
            n = len(lp)
            mask = torch.tensor(c.get("loss_mask") or [True] * n)
            lr.append((lp.double() - torch.tensor(c["generation_logprobs"]).double())[mask])
            adv.append(torch.tensor(c.get("advantages") or [row["advantage"]] * n,
                                    dtype=torch.float64)[mask])
        terms.append(torch.exp(torch.cat(lr).mean()) * torch.cat(adv).mean())
    total = -torch.stack(terms).mean()
    total.backward()
    want = _grads(hf)
    assert abs(loss.item() - total.item()) < 1e-6
    for name in want:
        scale = float(want[name].abs().max())
        assert float((got[name].double() - want[name]).abs().max()) <= 1e-4 * scale + 1e-7, name


def test_the_boundary(hf):
    policy = Policy(hf)
    # README's EPISODE_SCHEMA with no sample_index: numbered by row order, not "produced twice"
    table = pa.Table.from_pylist(_rows()[:2], schema=EPISODE_SCHEMA)
    assert table.column("sample_index").null_count == 2
    assert policy.logprobs(table).column("sample_index").to_pylist() == [0, 1]
    with pytest.raises(ValueError, match="'sample_index' is null.*validate_episodes"):
        Reassemble()(pa.table({}), episodes=table)  # the unvalidated table, refused by name
    with pytest.raises(ValueError, match="advantages has shape"):
        policy.loss(_rows(), advantages=[1.0, 2.0])
    with pytest.raises(ValueError, match="not in EPISODE_SCHEMA"):
        policy.logprobs([{"episode_id": "x", "turns": []}])
    with pytest.raises(TypeError, match="checkpoint directory or a transformers module"):
        Policy(3)
    with pytest.raises(TypeError, match="not a transformers model"):
        Policy(torch.nn.Linear(2, 2))
