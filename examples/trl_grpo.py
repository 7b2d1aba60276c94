"""TRL's GRPOTrainer with treeflow computing the policy's per-token logprobs (and entropies).

    trainer = TreeflowGRPOTrainer(model=hf_model, reward_funcs=reward, args=GRPOConfig(...),
                                  train_dataset=dataset, processing_class=tokenizer,
                                  treeflow_fragment=Fragment(max_tokens=8192))
    trainer.train()

TRL's extension point is `GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids,
attention_mask, logits_to_keep, ...)`: every logprob TRL uses (the policy's with autograd, the
old policy's, the reference model's) comes from it as a [batch, logits_to_keep] tensor over
the completion positions. `TreeflowGRPOTrainer` overrides it: each row (a left-padded prompt
and a right-padded completion, tool turns included) becomes one treeflow episode, the rows of
one prompt a group, so Pack lays each group out as one prefix tree (the prompt computed once)
and Fragment cuts trees over the budget; a `treeflow.train.Policy` adopts the very module TRL
trains (its parameters, not a copy), so TRL's loss, optimizer, accelerate and logging run
unchanged on gradients treeflow's forward produced. The trade-off: a batch is packed again on
every call (cheap next to the forward), and TRL's multimodal inputs and the MoE aux loss are
not carried (refused by name).

Long samples are kept, never dropped or cut: `treeflow_fragment.max_tokens` is the bin budget
trees are packed and fragmented to, and a row whose own context is longer than it (one call
cannot be split over bins without context parallelism) is scored in a batch planned with a
budget that holds it (the next power of two, so few kernel shapes), said on stderr. TRL's
AsyncGRPO drops such a sample (`TokenBudgetBatcher`, trl/experimental/async_grpo/
async_grpo_trainer.py, "Dropping a rollout sample ... exceeds token_budget"); GRPOTrainer,
the trainer this recipe extends, scores every row it generated (it caps the generation at
`max_completion_length` instead).

Several processes (accelerate's DDP): treeflow's forward runs on the unwrapped module, not
through DDP.forward, which is what arms DDP's gradient all-reduce, so `training_step` averages
the gradients over the processes itself on the micro-batch that ends an optimizer step (as
DDP would, before TRL clips them). FSDP and DeepSpeed are refused.

Run (CPU, a random tiny model; a real run gives a checkpoint and a dataset):
    python examples/trl_grpo.py
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import torch
from trl import GRPOConfig, GRPOTrainer

from treeflow.stages import Fragment
from treeflow.train import DataParallel, Policy

__all__ = ["TreeflowGRPOTrainer", "episodes_from_rows", "logps_to_rows"]


def episodes_from_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       logits_to_keep: int) -> list[dict]:
    """TRL's padded rows as treeflow episodes: one call per row, sampled from the completion.

    Rows with the same prompt tokens share a group_id, so the tree layout shares the prompt.
    """
    ids, mask = input_ids.cpu().numpy(), attention_mask.cpu().numpy().astype(bool)
    prompt_cols = ids.shape[1] - logits_to_keep
    episodes, groups = [], {}
    for b in range(len(ids)):
        prompt = ids[b, :prompt_cols][mask[b, :prompt_cols]]
        completion = ids[b, prompt_cols:][mask[b, prompt_cols:]]
        if len(prompt) == 0:
            raise ValueError(f"TRL row {b}: an empty prompt; treeflow scores a token from the "
                             "ones before it, so a call needs at least one prompt token")
        group = groups.setdefault(prompt.tobytes(), f"p{len(groups)}")
        episodes.append({"episode_id": f"row{b}", "group_id": group, "calls": [
            {"token_ids": np.concatenate([prompt, completion]).tolist(),
             "sampled_start": len(prompt)}]})
    return episodes


def logps_to_rows(values_S: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                  episode_S: torch.Tensor, offset_S: torch.Tensor) -> torch.Tensor:
    """Per-occurrence values back to TRL's [batch, logits_to_keep] (0 at padding)."""
    out = torch.zeros(attention_mask.shape[0], logits_to_keep, dtype=values_S.dtype,
                      device=values_S.device)
    return out.index_put((episode_S, offset_S), values_S)


class TreeflowGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose logprobs come from treeflow's prefix-tree forward on the same module."""

    def __init__(self, *args, treeflow_fragment: Fragment | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._treeflow_fragment = treeflow_fragment or Fragment(max_tokens=8192)
        self._policies: dict[tuple[int, int], Policy] = {}
        kind = self.accelerator.distributed_type.value
        if kind not in ("NO", "MULTI_CPU", "MULTI_GPU"):
            raise ValueError(f"TreeflowGRPOTrainer: accelerate's {kind}; treeflow's forward "
                             "bypasses its sharding hooks. Run single-process or plain DDP "
                             "(MULTI_GPU / MULTI_CPU)")

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.num_processes > 1 and self.accelerator.sync_gradients:
            self._average_gradients(model)
        return loss

    def _average_gradients(self, model) -> None:
        """DDP's gradient mean over the processes, which treeflow's forward did not arm."""
        params = [p for p in self.accelerator.unwrap_model(model).parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # every process reduces the same tensors
                p.grad = torch.zeros_like(p)
        dp = DataParallel(rank=self.accelerator.process_index,
                          world=self.accelerator.num_processes, device=str(params[0].device))
        dp.sum_tensors([p.grad for p in params])
        for p in params:
            p.grad.div_(self.accelerator.num_processes)

    def _policy(self, model, longest: int) -> Policy:
        """The Policy on `model`'s module whose bins hold a row of `longest` tokens."""
        module = self.accelerator.unwrap_model(model)
        fragment = self._treeflow_fragment
        if longest - 1 > fragment.max_tokens:  # the last sampled token's context: longest - 1
            budget = 1 << (longest - 2).bit_length()
            if (id(module), budget) not in self._policies:
                print(f"TreeflowGRPOTrainer: a row of {longest} tokens is longer than "
                      f"treeflow_fragment.max_tokens={fragment.max_tokens}; scoring its batches "
                      f"with bins of {budget} tokens (raise max_tokens to bound memory "
                      "up front)", file=sys.stderr)
            fragment = replace(fragment, max_tokens=budget)
        key = (id(module), fragment.max_tokens)
        policy = self._policies.get(key)
        if policy is None:  # built once per module and budget (the policy; the reference model)
            policy = self._policies[key] = Policy(module, fragment=fragment)
        return policy

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False,
                                           compute_aux_loss=False, **multimodal):
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given or compute_aux_loss:
            raise ValueError(f"TreeflowGRPOTrainer: {given or ['the MoE aux loss']} not carried "
                             "into treeflow episodes; use GRPOTrainer for this run")
        # TRL divides the logits by its sampling temperature before the log-softmax
        if self.temperature != 1.0:
            raise ValueError(f"TreeflowGRPOTrainer: temperature {self.temperature}; treeflow "
                             "scores the model's own distribution (GRPOConfig(temperature=1.0))")
        episodes = episodes_from_rows(input_ids, attention_mask, logits_to_keep)
        longest = int(attention_mask.sum(dim=1).max()) if len(attention_mask) else 0
        tokens = self._policy(model, longest).tokens(episodes, entropy=compute_entropy)  # grad as TRL's
        logps = logps_to_rows(tokens.logprobs, attention_mask, logits_to_keep, tokens.episode,
                              tokens.offset)
        entropies = None if not compute_entropy else logps_to_rows(
            tokens.entropies, attention_mask, logits_to_keep, tokens.episode, tokens.offset)
        return logps, entropies, None


def _demo() -> None:  # a tiny random model and tokenizer, two steps on CPU
    import tempfile

    import transformers
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["count to three", "one two three", "tool says hi"] * 10,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<eos>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                     pad_token="<eos>", padding_side="left")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, max_steps=2, learning_rate=1e-3,
                          use_cpu=True, report_to=[], logging_steps=1, temperature=1.0,
                          save_strategy="no")
        trainer = TreeflowGRPOTrainer(
            model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
            args=args, train_dataset=Dataset.from_dict({"prompt": ["count to three"] * 8}),
            processing_class=tokenizer, treeflow_fragment=Fragment(max_tokens=256))
        trainer.train()
        print(trainer.state.log_history[-1])


if __name__ == "__main__":
    _demo()
