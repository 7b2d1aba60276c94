"""--kl-coef with --ref-model (the KL term against a frozen reference policy), --entropy-coef.

The policy and the reference are two Hugging Face checkpoints written by transformers
(another seed for the reference). `treeflow replay --mode train --kl-coef C --ref-model REF`
must report, for its first step, the KL and loss that a plain transformers forward of each
call through both models gives by the hand formula (k3 = exp(r - p) - (r - p) - 1 per loss
token, token mean), and the gradient norm of that loss by transformers' own autograd. The
reference must stay frozen (the second step's KL is computed against the same reference),
and a KL without a reference, or a reference without a KL, is refused by its flag.
`--entropy-coef C` subtracts C times the mean entropy of the sampled tokens' distributions,
reported as train/entropy, against the same transformers forward.
"""

import json

import numpy as np
import pytest
import torch

from tests.deps import require
from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes

transformers = require("transformers")

VOCAB = 300
KL_COEF = 0.5


def _save(path, seed):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512,
                                      rope_theta=5000.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # spread the logits, so that the two models' logprobs differ widely
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("kl")
    policy, ref = _save(d / "policy", 0), _save(d / "ref", 1)
    eps = synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=12,
                         user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6),
                         vocab_size=VOCAB, seed=7)
    rows = eps.to_pylist()
    rng = np.random.default_rng(0)
    for row in rows:  # some tokens outside the loss: the KL's mean is over loss tokens only
        for c in row["calls"]:
            c["loss_mask"] = (rng.random(len(c["token_ids"]) - c["sampled_start"]) > 0.2).tolist()
    import pyarrow as pa

    data = str(d / "e.arrow")
    write_episodes(pa.Table.from_pylist(rows, schema=eps.schema), data)
    return d, data, rows, policy, ref


def _per_token(model, rows, grad=False, entropy=False):
    """Per loss token, the sampled token's logprob (or its distribution's entropy) from one
    plain causal forward per call."""
    out = []
    with torch.set_grad_enabled(grad):
        for row in rows:
            for c in row["calls"]:
                ids = torch.tensor([c["token_ids"]])
                lp = torch.log_softmax(model(ids).logits[0].float(), -1)
                s = c["sampled_start"]
                if entropy:
                    picked = -(lp[s - 1:-1].exp() * lp[s - 1:-1]).sum(-1)
                else:
                    picked = lp[s - 1:-1].gather(-1, ids[0, s:, None])[:, 0]
                out.append(picked[torch.tensor(c["loss_mask"])])
    return torch.cat(out)


def _grad_norm(model) -> float:
    norm = float(torch.sqrt(sum((q.grad.double() ** 2).sum() for q in model.parameters())))
    model.zero_grad(set_to_none=True)
    return norm


def test_kl_metric_loss_and_gradient_match_transformers(setup, capsys):
    d, data, rows, policy, ref = setup
    metrics = str(d / "m.jsonl")
    assert main(["replay", data, "--mode", "train", "--model", str(d / "policy"), "--loss", "nll",
                 "--norm", "token", "--episodes-per-step", "4", "--steps", "2", "--max-tokens",
                 "64", "--lr", "1e-3", "--kl-coef", str(KL_COEF), "--ref-model", str(d / "ref"),
                 "--metrics", metrics, "--quiet"]) == 0
    capsys.readouterr()
    first, second = [json.loads(line) for line in open(metrics)]
    # the hand formula on transformers' forwards of both models (float32)
    r = _per_token(ref, rows).double()
    p = _per_token(policy, rows, grad=True)
    dr = r - p.double().detach()
    want_kl = float((torch.exp(dr) - dr - 1).mean())
    assert 0.1 < want_kl < 5  # the two policies really differ (about 0.59)
    assert first["kl"] == pytest.approx(want_kl, rel=1e-4)
    assert first["train/kl"] == first["kl"]
    # the loss: token mean of -p + C * k3, and its gradient by transformers' autograd
    d_ = r.float() - p
    loss = (-p + KL_COEF * (torch.exp(d_) - d_ - 1)).mean()
    assert first["loss"] == pytest.approx(float(loss), rel=1e-5)
    loss.backward()
    assert first["grad_norm"] == pytest.approx(_grad_norm(policy), rel=1e-4)
    # step 2: the policy moved, the reference did not (its KL is against the same reference)
    assert second["kl"] is not None and second["kl"] != first["kl"]


@pytest.mark.multiprocess
def test_two_ranks_give_the_same_kl(setup, capsys):
    """--num-ranks 2: each rank's reference runs its own bins; the KL sums over the ranks."""
    d, data, rows, policy, ref = setup
    metrics = str(d / "m2.jsonl")
    assert main(["replay", data, "--mode", "train", "--model", str(d / "policy"), "--loss", "nll",
                 "--episodes-per-step", "4", "--steps", "1", "--max-tokens", "64",
                 "--num-ranks", "2", "--kl-coef", str(KL_COEF), "--ref-model", str(d / "ref"),
                 "--metrics", metrics, "--quiet"]) == 0
    capsys.readouterr()
    (row,) = [json.loads(line) for line in open(metrics)]
    r, p = _per_token(ref, rows).double(), _per_token(policy, rows).double()
    assert row["perf/ranks"] == 2 and row["perf/bins"] >= 2
    assert row["train/kl"] == pytest.approx(float((torch.exp(r - p) - (r - p) - 1).mean()),
                                            rel=1e-4)


def test_entropy_coef_bonus_and_metric_match_transformers(setup, capsys):
    d, data, rows, policy, _ = setup
    metrics = str(d / "ent.jsonl")
    assert main(["replay", data, "--mode", "train", "--model", str(d / "policy"), "--loss", "nll",
                 "--episodes-per-step", "4", "--steps", "1", "--max-tokens", "64",
                 "--entropy-coef", "0.2", "--metrics", metrics, "--quiet"]) == 0
    capsys.readouterr()
    (row,) = [json.loads(line) for line in open(metrics)]
    p = _per_token(policy, rows, grad=True)
    h = _per_token(policy, rows, grad=True, entropy=True)
    assert row["train/entropy"] == pytest.approx(float(h.mean()), rel=1e-5)
    assert row["train/kl"] is None
    loss = (-p - 0.2 * h).mean()  # the bonus is subtracted
    assert row["train/loss"] == pytest.approx(float(loss), rel=1e-5)
    loss.backward()
    assert row["train/grad_norm"] == pytest.approx(_grad_norm(policy), rel=1e-4)


def test_kl_flags_are_refused_without_their_partner(setup, capsys):
    d, data, *_ = setup
    base = ["replay", data, "--mode", "train", "--model", str(d / "policy"), "--loss", "nll",
            "--episodes-per-step", "4", "--steps", "1"]
    assert main([*base, "--kl-coef", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "--kl-coef 0.1" in err and "--ref-model DIR" in err
    assert main([*base, "--ref-model", str(d / "ref")]) == 2
    assert "--kl-coef C > 0" in capsys.readouterr().err


def test_trainer_without_reference_names_both_sources():
    from treeflow.stages import Forward, Loss, Reduce
    from treeflow.train import Trainer

    eps = synth_episodes(episodes=2, group_size=2, turns=(2, 2), seed=1)
    tr = Trainer(Forward(), Reduce(loss=Loss(kind="nll", kl_coef=0.1)))
    with pytest.raises(ValueError, match=r"reference=Forward\(model=REF_DIR\).*ref_logprobs"):
        tr.open_step(eps)
    with pytest.raises(ValueError, match="feeds only the KL penalty"):
        Trainer(Forward(), Reduce(loss=Loss(kind="nll")), reference=Forward())
