"""The rollout producer samples for real: its generation logprobs are the pipeline's logprobs."""

import numpy as np
import pyarrow as pa
import torch

from treeflow.models import load_model, save_model
from treeflow.models.backend import load_backend
from treeflow.pipeline import Pipeline
from treeflow.programs import Rollout, run_rollout, sample_group
from treeflow.programs.fidelity import generation_kl
from treeflow.stages import Forward, Fragment, Pack, Reassemble
from treeflow.tq import END, local_queue

CONFIG = Rollout(group_size=2, turns=(1, 2), prompt_tokens=(6, 10), completion_tokens=(3, 6),
                 tool_tokens=(2, 4), seed=7)


def logprobs(model, episodes, layout="tree"):
    pipe = Pipeline(Pack(layout=layout), Fragment(max_tokens=1024), Forward(model=model), Reassemble())
    return pa.concat_tables([rec.output for rec in pipe.run(episodes)])


def test_sampled_generation_logprobs_equal_the_pipeline_logprobs():
    backend = load_backend("reference", "tiny")
    eps = pa.concat_tables([sample_group(backend, CONFIG, g) for g in range(2)])
    assert sample_group(backend, CONFIG, 1).equals(eps.slice(2, 2))   # deterministic per group
    calls = eps.column("calls").to_pylist()
    assert calls[0][0]["token_ids"][:6] == calls[1][0]["token_ids"][:6]  # the group shares its prompt
    gen = np.concatenate([c["generation_logprobs"] for cs in calls for c in cs])
    assert np.all(gen < 0) and gen.std() > 0.01          # real sampled values, not constants
    for layout in ("tree", "exact"):
        fid = generation_kl(eps, logprobs("tiny", eps, layout))
        assert fid["gen_kl"] <= 1e-6 and fid["gen_logprob_max_diff"] < 1e-4, (layout, fid)


def test_refit_loads_published_weights_and_stamps_their_version(tmp_path):
    model = load_model("tiny")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_model(model, tmp_path / "v3")
    q = local_queue()
    q.publish_weights(3, str(tmp_path / "v3"))
    summary = run_rollout(q, groups=2, config=CONFIG)
    assert summary["refits"] == 1 and summary["weight_version"] == 3
    got = []
    while (step := q.get(4, timeout=5)) != END:
        got.append(step.episodes)
        q.ack(step)
    eps = pa.concat_tables(got)
    assert set(eps.column("weight_version").to_pylist()) == {3}
    assert generation_kl(eps, logprobs(str(tmp_path / "v3"), eps))["gen_kl"] <= 1e-6
    assert generation_kl(eps, logprobs("tiny", eps))["gen_kl"] > 1e-4   # not the old weights


def test_a_token_keeps_the_experts_of_the_step_that_first_computed_it(tmp_path):
    """MoE sampling replays each token's routes from the step that first computed it, at every
    later step and call (a KV cache keeps them), so the episode carries the routes its
    logprobs were sampled under. Recomputed routes can flip at a bf16 near-tie as the batch
    changes between steps; then the trainer, replaying the carried routes, scores other experts
    than the sampler ran (the gate's generation KL sat above its floor, bench/gate_kl_floor.py)."""
    from treeflow.models import ModelConfig
    from treeflow.models.checkpoint import seeded_decoder

    config = ModelConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True})
    save_model(seeded_decoder(config), tmp_path / "moe")
    backend = load_backend("reference", str(tmp_path / "moe"))
    steps = []   # (tokens_N, positions_N, routes_NW given to the forward) per sampling step
    forward = backend.hidden_states

    def spy(tokens_N, positions_N, plan, routes_NW=None, **kw):
        steps.append((tokens_N.numpy().copy(), positions_N.numpy().copy(),
                      None if routes_NW is None else routes_NW.numpy().copy()))
        return forward(tokens_N, positions_N, plan, routes_NW=routes_NW, **kw)

    backend.hidden_states = spy
    eps = sample_group(backend, Rollout(group_size=3, turns=(2, 3), prompt_tokens=(6, 10),
                                        completion_tokens=(3, 6), tool_tokens=(2, 4), seed=3), 0)
    finals = []   # each episode's whole context and the routes its last call carries
    for calls in eps.column("calls").to_pylist():
        for a, b in zip(calls, calls[1:]):   # a later call carries the earlier call's routes
            n = len(a["token_ids"]) - 1
            assert np.array_equal(np.asarray(a["routed_experts"])[:n],
                                  np.asarray(b["routed_experts"])[:n])
        finals.append((np.asarray(calls[-1]["token_ids"]),
                       np.asarray(calls[-1]["routed_experts"])))
    new_rows = 0
    for tokens_N, positions_N, given_NW in steps[1:]:
        assert given_NW is not None, "a sampling step recomputed every route"
        starts = np.flatnonzero(positions_N == 0)
        for lo, hi in zip(starts, [*starts[1:], len(tokens_N)]):
            tokens, given = tokens_N[lo:hi], given_NW[lo:hi]
            ep = [i for i, (t, _) in enumerate(finals) if np.array_equal(t[:hi - lo], tokens)]
            assert ep, "a sampled context is no episode's prefix"
            old = (given >= 0).all(-1)
            n_old = int(old.sum())
            assert old[:n_old].all() and n_old >= 1       # the known rows are the first ones
            assert np.array_equal(given[:n_old], finals[ep[0]][1][:n_old])
            new_rows += (hi - lo) - n_old
    assert 0 < new_rows < sum(len(t) for t, _ in finals)
