"""examples/trl_grpo.py against the real TRL package: TreeflowGRPOTrainer's logprobs, entropies
and their gradients equal GRPOTrainer's own computation on the same padded rows (dense model,
short samples, float32 on CPU), and one TRL training step runs through treeflow. A row longer
than the budget, which TRL's AsyncGRPO batcher drops (checked with TRL's own
`TokenBudgetBatcher`), is scored whole, equal to transformers on that sequence alone.

The oracle is TRL's own `GRPOTrainer._get_per_token_logps_and_entropies` (transformers' forward
of the padded batch); the rows are built by hand: a group of three completions of one
left-padded prompt and a multi-turn row (assistant, tool result, assistant) of another prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.deps import require

require("trl")
transformers = require("transformers")
datasets = require("datasets")

from examples.trl_grpo import TreeflowGRPOTrainer  # noqa: E402
from treeflow.stages import Fragment  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

VOCAB = 67


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from tests.io.conftest import build_tokenizer

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(
        build_tokenizer(str(tmp_path_factory.mktemp("tok"))))
    tok.padding_side = "left"
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    with torch.no_grad():  # weights far from init, so a wrong position or mask cannot hide
        for p in model.parameters():
            p.mul_(4.0)
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=1,
                      learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                      temperature=1.0, bf16=False)  # float32: TRL defaults to bf16 autocast
    tr = TreeflowGRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["List the files."] * 8}),
        processing_class=tok, treeflow_fragment=Fragment(max_tokens=24))
    yield tr
    torch.set_num_threads(n)


def _batch():
    """[4, P + C] rows: prompts left-padded (one shared by rows 0-2), completions right-padded."""
    rng = np.random.default_rng(1)
    t = lambda n: rng.integers(1, 300, n).tolist()  # noqa: E731
    shared, other = t(7), t(5)
    turns = t(3) + t(4) + t(3)  # assistant, tool result, assistant: one multi-turn completion
    rows = [(shared, t(6)), (shared, t(4)), (shared, t(2)), (other, turns)]
    P, C = 7, 10
    ids = torch.zeros(4, P + C, dtype=torch.long)
    mask = torch.zeros(4, P + C, dtype=torch.long)
    for b, (p, c) in enumerate(rows):
        ids[b, P - len(p):P], mask[b, P - len(p):P] = torch.tensor(p), 1
        ids[b, P:P + len(c)], mask[b, P:P + len(c)] = torch.tensor(c), 1
    return ids, mask, C


def test_logprobs_entropies_and_gradients_equal_trl(trainer):
    ids, mask, keep = _batch()
    comp = mask[:, -keep:].bool()
    model = trainer.model
    out = {}
    for name, fn in (("trl", GRPOTrainer._get_per_token_logps_and_entropies),
                     ("treeflow", TreeflowGRPOTrainer._get_per_token_logps_and_entropies)):
        model.zero_grad(set_to_none=True)
        logps, ent, _ = fn(trainer, model, ids, mask, keep, compute_entropy=True)
        (logps[comp] * torch.linspace(-1, 1, int(comp.sum()))).sum().backward()
        out[name] = (logps.detach()[comp], ent.detach()[comp],
                     {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = out["trl"], out["treeflow"]
    assert len(lp_a) == 6 + 4 + 2 + 10
    # float32 forwards in two layouts (a padded batch vs one prefix tree per group)
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=0, atol=2e-5)
    for n in g_a:
        scale = float(g_a[n].abs().max())
        assert float((g_b[n] - g_a[n]).abs().max()) <= 1e-4 * scale + 1e-7, n


def test_a_trl_step_runs_through_treeflow(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 1
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_a_sample_trl_would_drop_is_kept_and_scored_whole(trainer, capsys):
    """A row longer than the budget: TRL's AsyncGRPO batcher (its own code) drops it; the recipe
    scores it whole, each token equal to transformers' forward of that one unpadded sequence."""
    from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher

    budget = trainer._treeflow_fragment.max_tokens  # 24, as TRL's token_budget below
    rng = np.random.default_rng(2)
    prompt, long_completion = rng.integers(1, 300, 7).tolist(), rng.integers(1, 300, 30).tolist()
    short = rng.integers(1, 300, 5).tolist()
    long_row, short_row = prompt + long_completion, prompt + short
    assert len(long_row) - 1 > budget

    def sample(ids, group):
        mask = torch.zeros(len(ids), dtype=torch.long)
        mask[len(prompt):] = 1
        return {"input_ids": torch.tensor(ids), "completion_mask": mask, "group_id": group}

    metrics = {"batch/dropped_oversize_total": []}
    closer = rng.integers(300, 600, 20).tolist()  # fits no row with short_row: closes its batch
    batches = list(TokenBudgetBatcher([sample(long_row, "a"), sample(short_row, "b"),
                                       sample(closer, "c")],
                                      num_processes=1, token_budget=budget, metrics=metrics))
    kept = [s["input_ids"].tolist() for rows in batches for row in rows for s in row.samples]
    assert kept == [short_row] and metrics["batch/dropped_oversize_total"] == [1.0]

    P, C = len(prompt), len(long_completion)
    ids = torch.zeros(2, P + C, dtype=torch.long)
    mask = torch.zeros(2, P + C, dtype=torch.long)
    for b, row in enumerate((long_row, short_row)):
        ids[b, :len(row)], mask[b, :len(row)] = torch.tensor(row), 1
    logps, _, _ = TreeflowGRPOTrainer._get_per_token_logps_and_entropies(
        trainer, trainer.model, ids, mask, C)
    assert "a row of 37 tokens is longer than treeflow_fragment.max_tokens=24" in \
        capsys.readouterr().err
    with torch.no_grad():  # the oracle: transformers on each unpadded sequence alone
        for b, row in enumerate((long_row, short_row)):
            logits = trainer.model(torch.tensor([row])).logits[0].float()
            want = torch.log_softmax(logits[:-1], -1).gather(
                1, torch.tensor(row[1:])[:, None])[:, 0][P - 1:]
            got = logps[b, :len(row) - P].detach()
            assert len(got) == len(want) == len(row) - P
            torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
