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
