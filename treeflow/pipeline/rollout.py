"""A real rollout producer: agentic episodes sampled from a policy, put into a tensor queue.

Each GRPO group shares a prompt; each of its episodes makes `turns` calls.
A call's completion is *sampled* from the model token by token (temperature
sampling from the full softmax), and its `generation_logprobs` are the
sampling distribution's log-probabilities of the sampled tokens, so a trainer
fed with these episodes sees importance ratios of 1 up to numerics. Between
calls a synthetic tool output (random tokens) is appended, so call k+1's
prompt is call k's prompt + completion + tool output. The reward is
synthetic (the share of sampled token ids below vocab/2, something a policy
can learn); advantages are group-normalised rewards.

The trade-off: no KV cache. Every sampled token recomputes the whole group
(all its episodes' contexts as one forest of causal chains), O(T^2) per call,
which is fine for the tiny default model and small checkpoints and keeps the
sampling path the reference decoder's own forward. Sampling is seeded by
(seed, group index), so a restarted producer regenerates exactly the groups
the queue has not accepted.

Refit: before each group the producer looks for weights published by the
trainer (`queue.weights()`); newer ones are loaded and the group's episodes
carry that `weight_version`.

Legend: G episodes of a group, N tokens of the group's forest, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import EPISODE_SCHEMA, validate_episodes

__all__ = ["Rollout", "run_rollout", "sample_group"]


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """What to sample: group shape, turn shape, sampling temperature, seed. Ranges are inclusive."""

    group_size: int = 4
    turns: tuple[int, int] = (2, 3)
    prompt_tokens: tuple[int, int] = (16, 32)
    completion_tokens: tuple[int, int] = (4, 12)
    tool_tokens: tuple[int, int] = (4, 12)
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.group_size < 1:
            raise ValueError(f"Rollout(group_size={self.group_size}): give >= 1")
        for name, floor in (("turns", 1), ("prompt_tokens", 1), ("completion_tokens", 1),
                            ("tool_tokens", 0)):
            lo, hi = getattr(self, name)
            if not floor <= lo <= hi:
                raise ValueError(f"Rollout({name}={(lo, hi)}): give an inclusive range with "
                                 f"{floor} <= lo <= hi")
        if not self.temperature > 0:
            raise ValueError(f"Rollout(temperature={self.temperature}): give > 0")


def _sample_step(backend, contexts: list[np.ndarray], temperature: float, gen):
    """One sampled token per context (one forest of causal chains): ids and their logprobs."""
    import torch

    lens = np.array([len(c) for c in contexts], dtype=np.int64)
    ends = np.cumsum(lens)
    tokens_N = np.concatenate(contexts).astype(np.int64)
    positions_N = np.arange(len(tokens_N)) - np.repeat(ends - lens, lens)
    parents_N = np.where(positions_N == 0, -1, np.arange(len(tokens_N)) - 1)
    plan = backend.attention_plan(parents_N, np.repeat(ends, lens), kernel="auto")
    dev = backend.device
    with torch.no_grad():
        hidden_NH = backend.hidden_states(torch.from_numpy(tokens_N).to(dev),
                                          torch.from_numpy(positions_N).to(dev), plan)
        logits_GV = backend.module.project(hidden_NH[torch.from_numpy(ends - 1).to(dev)]).float()
        logp_GV = torch.log_softmax(logits_GV / temperature, dim=-1)
        ids_G = torch.multinomial(logp_GV.exp().cpu(), 1, generator=gen)[:, 0]
        lp_G = logp_GV.cpu().gather(-1, ids_G[:, None])[:, 0]
    return ids_G.numpy().astype(np.int32), lp_G.numpy().astype(np.float32)


def sample_group(backend, config: Rollout, group: int, *, version: int = 0, producer: str = "rollout",
                 index_base: int = 0) -> pa.Table:
    """One GRPO group of sampled multi-turn episodes (EPISODE_SCHEMA rows), deterministic per group."""
    import torch

    rng = np.random.default_rng([config.seed, group])
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    vocab = backend.config.vocab_size
    G = config.group_size

    def draw(bounds):
        return rng.integers(1, vocab, size=int(rng.integers(bounds[0], bounds[1] + 1)), dtype=np.int32)

    prompt = draw(config.prompt_tokens)
    n_turns = [int(rng.integers(config.turns[0], config.turns[1] + 1)) for _ in range(G)]
    contexts = [prompt.copy() for _ in range(G)]
    calls: list[list[dict]] = [[] for _ in range(G)]
    for turn in range(max(n_turns)):
        live = [g for g in range(G) if turn < n_turns[g]]
        if turn:
            for g in live:  # the tool answered the previous call
                contexts[g] = np.concatenate([contexts[g], draw(config.tool_tokens)])
        starts = {g: len(contexts[g]) for g in live}
        length = int(rng.integers(config.completion_tokens[0], config.completion_tokens[1] + 1))
        lps = {g: [] for g in live}
        for _ in range(length):
            ids, lp = _sample_step(backend, [contexts[g] for g in live], config.temperature, gen)
            for k, g in enumerate(live):
                contexts[g] = np.append(contexts[g], ids[k])
                lps[g].append(lp[k])
        for g in live:
            calls[g].append({"token_ids": contexts[g].tolist(), "sampled_start": starts[g],
                             "generation_logprobs": lps[g]})
    reward = np.array([np.mean([np.mean(np.array(c["token_ids"][c["sampled_start"]:]) < vocab // 2)
                                for c in calls[g]]) for g in range(G)], dtype=np.float32)
    adv = (reward - reward.mean()) / (reward.std() + 1e-6)
    rows = [{"episode_id": f"{producer}-g{group}-e{g}", "group_id": f"{producer}-g{group}",
             "sample_index": index_base + group * G + g, "reward": float(reward[g]),
             "advantage": float(adv[g]), "weight_version": int(version), "calls": calls[g]}
            for g in range(G)]
    return validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA),
                             source=f"rollout {producer} group {group}", vocab_size=vocab)


def run_rollout(queue, *, groups: int, config: Rollout = Rollout(), model: str = "tiny",
                device: str = "cpu", dtype: str = "float32", producer: str = "rollout",
                index_base: int = 0, rate: float | None = None, refit: bool = True,
                close: bool = True, put_timeout: float = 600.0, log=None) -> dict:
    """Sample `groups` groups into `queue` (one put per group), resuming after accepted puts.

    rate: episodes per second at most (None: as fast as sampling goes; a full
    queue blocks the producer). refit: load newer weights published on the
    queue before each group. close: close this producer at the end (the queue
    closes once every producer has, as its close_when says). The producer id
    is claimed first: one that a live producer holds is refused before any
    sampling.
    """
    import torch

    from treeflow.models.backend import load_backend

    start = queue.open_producer(producer)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    backend = load_backend("reference", model, dtype=dtypes[dtype], device=device)
    version, refits, put = 0, 0, 0
    t0 = time.perf_counter()
    for group in range(start, groups):
        published = queue.weights() if refit else None
        if published is not None and published[0] > version:
            backend = load_backend("reference", published[1], dtype=dtypes[dtype], device=device)
            version, refits = published[0], refits + 1
        table = sample_group(backend, config, group, version=version, producer=producer,
                             index_base=index_base)
        if rate:
            time.sleep(max(0.0, t0 + put / rate - time.perf_counter()))
        queue.put(table, producer=producer, seq=group, timeout=put_timeout)
        put += table.num_rows
        if log is not None:
            log(group, table, version)
    if close:
        queue.close(producer=producer)
    return {"groups": groups - start, "episodes": put, "resumed_at": start, "refits": refits,
            "weight_version": version, "seconds": round(time.perf_counter() - t0, 3)}
