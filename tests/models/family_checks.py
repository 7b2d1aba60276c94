"""The checks every dense family passes against transformers' own class, call by call in
float32 (tests/models/reference/test_qwen3.py, test_gemma3.py): layouts with fragments and GRPO groups
(logprobs and every parameter gradient), random forks through each tree kernel, a training
step saved back, and the CLI. `hf` is the transformers model, `path` its saved checkpoint."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from models_helpers import hf_call_logprobs, path_to, tree_tensors

from tests.models.families_helpers import VOCAB, transformers
from tests.models.moe_helpers import hf_occurrence_logprobs, occurrence_logprobs
from treeflow.models import AttentionPlan, ReferenceBackend, load_model, save_model
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Pack
from treeflow.stages.fragment import fragment
from treeflow.tree import subtree_end

LAYOUTS = ("tree", "chain", "exact")


def _weights(keys):
    rng = np.random.default_rng(7)
    return {k: float(rng.uniform(0.5, 1.5)) for k in sorted(keys)}


def check_layouts(hf, ours, rows, *, max_tokens: int, kernel: str, fragmented: bool,
                  forced=None) -> None:
    """Every sampled token's logprob and every parameter gradient of a weighted sum of them:
    tree (the groups' prompts shared), chain and exact, under a `max_tokens` budget, =
    transformers call by call (1e-5 absolute on logprobs, 1e-5 of each tensor's largest entry
    on gradients: float32 sums in another order). forced: the rows' routes replayed
    (routing="replay") and forced into transformers' routers by this patch
    (hybrid_moe_helpers.forced_routes); None: every router chooses."""
    replay = forced is not None
    oracle = dict(replay=replay, **({"forced": forced} if replay else {}))
    with torch.no_grad():
        want = hf_occurrence_logprobs(hf, rows, **oracle)
    w = _weights(want)
    hf.zero_grad()
    sum(w[k] * v for k, v in hf_occurrence_logprobs(hf, rows, **oracle).items()).backward()
    hf_grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    tokens = {}
    for layout in LAYOUTS:
        ours.zero_grad()
        got, _, bins = occurrence_logprobs(ours, rows, layout=layout,
                                           routing="replay" if replay else "auto",
                                           max_tokens=max_tokens, kernel=kernel)
        assert got.keys() == want.keys()
        diff = max(abs(float(got[k].detach()) - float(want[k])) for k in want)
        assert diff < 1e-5, (layout, max_tokens, diff)
        sum(w[k] * v for k, v in got.items()).backward()
        names = dict(ours.named_parameters())
        assert names.keys() == hf_grads.keys()
        for n, g in hf_grads.items():
            scale = float(g.abs().max())
            assert scale > 0 and names[n].grad is not None, n
            assert float((names[n].grad - g).abs().max()) <= 1e-5 * scale, (layout, n)
        tokens[layout] = sum(len(p) for p in bins.column("positions").to_pylist())
        if fragmented and layout == "tree":
            assert bins.num_rows > 2  # the budget really cut trees into fragments
    assert tokens["tree"] < tokens["exact"]  # the tree really shared the groups' prompts


def check_forks(hf, ours, tokens, parents, kernel: str) -> None:
    """A forest through `kernel`: every node's next-token logprobs = transformers on the
    node's root path alone."""
    toks, pos, end = tree_tensors(tokens, parents)
    plan = AttentionPlan(end, kernel=kernel, parents_N=parents if kernel == "runs" else None)
    with torch.no_grad():
        got = torch.log_softmax(ours.project(ours(toks, pos, plan)), -1)
        for node in range(len(tokens)):
            path = path_to(parents, node)
            want = torch.log_softmax(hf(torch.as_tensor(tokens[path])[None]).logits[0, -1], -1)
            torch.testing.assert_close(got[node], want, atol=1e-5, rtol=0)


def check_training(hf, path, rows, tmp_path, *, kernel: str,
                   changed: str = "self_attn.q_norm") -> None:
    """A Trainer step (token-mean NLL over fragments of the tree layout): its loss and every
    float64-summed gradient = the hand formula on transformers call by call; after the
    optimizer step (which moved the `changed` parameter) the saved checkpoint loads in
    transformers as the same class and gives treeflow's logprobs."""
    from treeflow.stages import Loss, Reduce
    from treeflow.train import Trainer

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
    trainer = Trainer(Forward(kernel=kernel), Reduce(loss=Loss(kind="nll")), model=ours,
                      grad_sum="float64")
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    step = trainer.open_step(table)
    step.add(fragment(Pack(layout="tree")(table), max_tokens=40))
    assert abs(step.loss_sum - float(want.detach())) < 1e-5 * abs(float(want.detach()))
    for n, p in hf.named_parameters():
        g, mine = p.grad.double(), step._grad64[n]
        assert float((mine - g).abs().max()) <= 1e-5 * float(g.abs().max()), n
    step.finish()
    name = f"model.layers.0.{changed}" + ("" if changed.endswith("sinks") else ".weight")
    assert not torch.equal(ours.state_dict()[name], load_model(path).state_dict()[name])
    save_model(ours, tmp_path / "after")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "after").eval()
    assert type(back).__name__ == type(hf).__name__
    seq = rows[0]["calls"][-1]["token_ids"]
    with torch.no_grad():
        n = len(seq)  # the backend's plan: a recurrent family's carries its segments
        plan = ReferenceBackend(ours).attention_plan(np.arange(-1, n - 1), subtree_end(
            np.arange(n)), kernel="causal")
        mine = torch.log_softmax(ours.project(ours(torch.as_tensor(seq), torch.arange(n),
                                                   plan)), -1)
        theirs = torch.log_softmax(back(torch.as_tensor([seq])).logits[0], -1)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def check_cli_replay(hf, path, tmp_path) -> None:
    """`treeflow replay EPISODES --model DIR` as README says (tree layout, trees cut into
    fragments of 48 tokens): the sampled tokens' logprobs = transformers call by call."""
    from treeflow.cli import main
    from treeflow.tools import synth_episodes, write_episodes

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


def check_cli(hf, path, tmp_path, capsys) -> None:
    """check_cli_replay, then `--mode train --save` writes a checkpoint transformers loads as
    the same class."""
    from treeflow.cli import main

    check_cli_replay(hf, path, tmp_path)
    assert main(["replay", str(tmp_path / "e.arrow"), "--model", str(path), "--mode", "train",
                 "--episodes-per-step", "2", "--steps", "1", "--loss", "nll",
                 "--max-tokens", "48", "--save", str(tmp_path / "ckpt"), "--quiet"]) == 0
    capsys.readouterr()
    saved = next(p.parent for p in (tmp_path / "ckpt").rglob("config.json"))
    back = transformers.AutoModelForCausalLM.from_pretrained(saved)
    assert type(back).__name__ == type(hf).__name__
    assert type(load_model(saved)) is type(load_model(path))
