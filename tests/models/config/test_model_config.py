"""ModelConfig reads Llama/Qwen2 config.json files and refuses what it cannot compute."""

from __future__ import annotations

import pytest

from treeflow.models import ModelConfig

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
         "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "rope_scaling": None, "tie_word_embeddings": True,
         "bos_token_id": 1, "eos_token_id": [2, 3]}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 21}


def test_reads_transformers_4_and_5_formats():
    llama = ModelConfig.from_hf_dict(LLAMA)
    assert (llama.rope_theta, llama.head_dim, llama.rms_norm_eps) == (500000.0, 16, 1e-5)
    assert llama.tie_word_embeddings and not llama.attention_bias
    assert llama.hf_extras["eos_token_id"] == [2, 3]
    qwen = ModelConfig.from_hf_dict(QWEN2)
    assert qwen.rope_theta == 1e6 and qwen.attention_bias and qwen.num_key_value_heads == 1
    assert not qwen.tie_word_embeddings
    again = ModelConfig.from_hf_dict(qwen.to_hf_dict())
    assert again == qwen and again.hf_extras["sliding_window"] == 4096


def test_tiny_is_the_documented_default():
    c = ModelConfig.tiny()
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.intermediate_size, c.head_dim) == (32000, 64, 2, 4, 2, 128, 16)
    assert c.tie_word_embeddings and c.rope_theta == 10000.0


@pytest.mark.parametrize("base,change,message", [
    (LLAMA, {"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
    (LLAMA, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    (QWEN2, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "yarn"),
    (QWEN2, {"use_sliding_window": True}, "use_sliding_window"),
    (QWEN2, {"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    (LLAMA, {"sliding_window": 4096}, "sliding_window=4096"),
    (LLAMA, {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    (LLAMA, {"attention_bias": True}, "attention_bias"),
    (LLAMA, {"hidden_act": "gelu"}, "gelu"),
    (LLAMA, {"num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_features_are_refused(base, change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**base, **change})
