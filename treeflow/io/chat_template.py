"""Chat logs without token ids, tokenised with a Hugging Face tokenizer's chat template.

Each line holds OpenAI-style `messages` (role, content, tool_calls, ...) and
optionally `tools`. Every assistant message becomes one call: its prompt is
the template applied to the messages before it with the generation prompt,
its sampled span is the rest of the template applied through it. The
tokenizer is loaded from a local directory (`--tokenizer DIR`:
tokenizer.json + tokenizer_config.json with a `chat_template`).

This is retokenisation, and the trade-off is stated, not hidden: text that
the engine produced token by token is encoded again, so the ids can differ
from what was sampled (merges across the prompt/completion boundary, templates
that rewrite earlier turns, e.g. dropping reasoning), logprobs cannot be
attached, and a call's sequence need not be a prefix of the next call's
prompt -- which loses tree sharing and makes replayed logprobs differ from
the engine's. `convert` reports how many calls are not prefixes of the next;
capture token ids at inference time (the `openai` format) to be exact.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from treeflow.io.records import FieldMap, lookup

RETOKENISE_WARNING = ("chat logs without token ids are retokenised with the chat template: the ids are "
                      "not guaranteed to be the ones the engine sampled, and there are no engine "
                      "logprobs; log token ids (vLLM `return_token_ids`) for exact replay")


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """A local Hugging Face tokenizer with a chat template (no hub access)."""
    if not os.path.isdir(path):
        raise ValueError(f"--tokenizer {path}: not a directory; give a local tokenizer directory "
                         "(tokenizer.json + tokenizer_config.json with a chat_template)")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError('the chat format needs transformers: pip install "treeflow[hf]"') from e
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer ({e})") from e
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"--tokenizer {path}: the tokenizer has no chat_template; save one in "
                         "tokenizer_config.json (or chat_template.jinja)")
    return tok


@dataclass(frozen=True, kw_only=True)
class ChatTemplateTokens:
    """Converter for chat logs with text only: retokenised through a chat template."""

    name = "chat"
    retokenised = True

    tokenizer: str
    fields: FieldMap = field(default_factory=FieldMap)
    messages_field: str = "messages"
    tools_field: str | None = "tools"

    def __post_init__(self):
        if not isinstance(self.tokenizer, (str, os.PathLike)):
            raise ValueError(f"ChatTemplateTokens(tokenizer={self.tokenizer!r}): give a directory path")

    def episode(self, record: dict, where: str, *, path: str, line: int) -> dict:
        tok = load_tokenizer(os.fspath(self.tokenizer))
        out = self.fields.episode(record, where, path=path, line=line)
        messages = lookup(record, self.messages_field, where, option="--messages-field")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{where}: field {self.messages_field!r} must be a list of message objects")
        tools = None
        if self.tools_field is not None:
            tools = lookup(record, self.tools_field, where, default=None)
        calls = []
        for i, msg in enumerate(messages):
            if "role" not in msg:
                raise ValueError(f"{where}, message {i}: no 'role'; give system/user/assistant/tool")
            if msg["role"] != "assistant":
                continue
            calls.append(self._call(tok, messages, i, tools, f"{where}, message {i}"))
        if not calls:
            raise ValueError(f"{where}: no assistant message; nothing was sampled")
        out["calls"] = calls
        return out

    @staticmethod
    def _call(tok, messages: list[dict], i: int, tools, where: str) -> dict:
        try:
            prompt_text = tok.apply_chat_template(messages[:i], tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
            full_text = tok.apply_chat_template(messages[:i + 1], tools=tools, tokenize=False)
        except Exception as e:  # jinja errors name the template problem
            raise ValueError(f"{where}: the chat template failed on this conversation: {e}") from e
        if not full_text.startswith(prompt_text):
            raise ValueError(f"{where}: the template renders the conversation through this message "
                             "so that it does not start with the prompt it renders for it; this "
                             "template cannot be replayed by retokenising: log token ids instead")
        prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
        completion = tok(full_text[len(prompt_text):], add_special_tokens=False)["input_ids"]
        if not prompt:
            raise ValueError(f"{where}: the template renders an empty prompt; a call needs at least "
                             "one prompt token")
        return {"token_ids": list(prompt) + list(completion), "sampled_start": len(prompt),
                "generation_logprobs": None, "loss_mask": None, "advantages": None,
                "routed_experts": None}
