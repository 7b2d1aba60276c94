"""A small local Hugging Face tokenizer with a ChatML-style chat template (no hub access).

The template drops the reasoning ("<think>...</think>") of every assistant turn
but the last, as Qwen3's does, so that retokenised calls can stop being
prefixes of the next call's prompt.
"""

import os

import pytest

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ (m['content'] or '').split('</think>')[-1] }}"
    "{% else %}{{ m['content'] or '' }}{% endif %}"
    "{% for t in m.get('tool_calls') or [] %}<tool_call>{{ t['function']['name'] }}"
    "({{ t['function']['arguments'] }})</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "You are a shell agent.", "List the files.", "There are two files.", "a.txt b.txt",
    "Let me look.", "Go on.", "Done.", "use ls", "system user assistant tool Tools",
] * 20


def build_tokenizer(path: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))
