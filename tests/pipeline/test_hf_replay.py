"""A checkpoint written by Hugging Face transformers replays to transformers' own logprobs."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.deps import require
from treeflow.pipeline import Pipeline
from treeflow.tools import synth_episodes
from treeflow.stages import Forward, Fragment, Pack, Reassemble

transformers = require("transformers")  # fails, not skips, in CI


def _save(kind, path):
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=5000.0)
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **common))
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_replay_matches_transformers_per_call(tmp_path, kind):
    hf = _save(kind, tmp_path / kind)
    eps = synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=24, user_tokens=(4, 8),
                         completion_tokens=(3, 8), tool_tokens=(3, 8), vocab_size=300, seed=5)
    pipe = Pipeline(Pack(layout="tree"), Fragment(max_tokens=120), Forward(model=str(tmp_path / kind)),
                    Reassemble())
    out = pa.concat_tables([r.output for r in pipe.run(eps)])
    worst = 0.0
    with torch.no_grad():
        for ep, row in zip(eps.to_pylist(), out.to_pylist()):
            for call, got in zip(ep["calls"], row["logprobs"]):
                ids = torch.tensor([call["token_ids"]])
                lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
                s = call["sampled_start"]
                want = lp[s - 1:-1].gather(-1, ids[0, s:, None])[:, 0].numpy()
                worst = max(worst, float(np.abs(np.asarray(got) - want).max()))
    assert worst < 1e-4
