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
sampling path the reference decoder's own forward. An MoE model's routes are those
of the step that first computed each token, replayed at every later step (what a
KV cache keeps): recomputed, a near-tie row could flip between steps as the batch
shape changes, and a token's logprob would be sampled under other experts than the
episode carries (the trainer replays the carried ones). Sampling is seeded by
(seed, group index), so a restarted producer regenerates exactly the groups
the queue has not accepted.

Refit: before each group the producer looks for weights published by the
trainer (`queue.weights()`); newer ones are loaded and the group's episodes
carry that `weight_version`. `max_lag=K` with `groups_per_step=G` makes the
producer wait, before group g, for weights of version >= g // G - K: with
K = 0 every step is sampled from the weights it trains (on-policy, and the
whole loop deterministic given the seeds).

Memory: when the next group needs weights the trainer has not published yet (the
last group of a step under `max_lag`), the producer releases its model before it
puts the group -- the weights dropped, the process's cached device blocks
returned (`torch.cuda.empty_cache`) -- and loads the published weights when they
come, which a refit does anyway. So while the trainer steps on the group's step
the sampler holds nothing on the device, and it never holds two copies (the old
model goes before the new one loads); the summary's `sampler` says what it held
(`weights_bytes`, `held_while_waiting_bytes`, `releases`, `loads`). The cost:
one `empty_cache` per step, and a model loaded from the published files even
where the wait would have been short (the load happens either way).

Environments: prompts, tool outputs, rewards and advantages come from an
`Environment` (subclass it for your task); the default is the synthetic one
above (random prompts and tool outputs, GRPO advantages).

Legend: G episodes of a group, N tokens of the group's forest, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from treeflow.schemas.episode import EPISODE_SCHEMA, validate_episodes

__all__ = ["Environment", "Rollout", "run_rollout", "sample_group"]


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


class Environment:
    """The task of a rollout: prompts, tool outputs, rewards, advantages. Subclass it.

    Every method gets the group's numpy Generator `rng` (draws from it are
    deterministic per (seed, group)); token ids must lie in [1, vocab).
    """

    def prompt(self, rng: np.random.Generator, config: Rollout, vocab: int) -> np.ndarray:
        """The group's shared prompt (int32 token ids)."""
        return _draw(rng, config.prompt_tokens, vocab)

    def tool(self, rng: np.random.Generator, config: Rollout, vocab: int,
             context: np.ndarray, call: int) -> np.ndarray:
        """The tool output appended after call `call` (0-based) of an episode whose tokens are
        `context` so far (prompt, completions and earlier tool outputs)."""
        return _draw(rng, config.tool_tokens, vocab)

    def reward(self, calls: list[dict], vocab: int) -> float:
        """One episode's reward from its calls (`token_ids`, `sampled_start`)."""
        return float(np.mean([np.mean(np.asarray(c["token_ids"][c["sampled_start"]:]) < vocab // 2)
                              for c in calls]))

    def advantages(self, reward_G: np.ndarray) -> np.ndarray:
        """Per-episode advantages of one group from its rewards (GRPO: group-normalised)."""
        return (reward_G - reward_G.mean()) / (reward_G.std() + 1e-6)


def _draw(rng, bounds, vocab):
    return rng.integers(1, vocab, size=int(rng.integers(bounds[0], bounds[1] + 1)), dtype=np.int32)


def _route_capture(backend):
    """(per-layer choices, hook handles) recording each MoE layer's top-k experts; None if dense.

    A forward pre-hook on every expert block computes the block's own choice
    from its input (`own_routes`: the router's own top-k, as the block
    chooses), so the routes the producer samples under are recorded without
    changing the forward. Layers in model order: MoE layers x top_k per token.
    """
    if getattr(backend.config, "moe", None) is None:
        return None
    blocks = [m for m in backend.module.modules() if hasattr(m, "own_routes")]
    seen: dict = {}

    def hook(block, inputs):
        seen[block.layer_index] = block.own_routes(inputs[0])

    return seen, [b.register_forward_pre_hook(hook) for b in blocks]


def _sample_step(backend, contexts: list[np.ndarray], temperature: float, gen, capture=None,
                 known: list[np.ndarray] | None = None):
    """One sampled token per context (one forest of causal chains): ids, logprobs, routes.

    routes: with `capture` (an MoE model) each context's expert ids [its length, MoE
    layers x top_k] as int16, else None. known: each context's routes fixed by earlier steps
    (its first rows): replayed here, as a KV cache keeps a token's experts from the step that
    first computed it, so the sampled logprobs are those of the routes the episode carries;
    the rows after them choose their own experts.
    """
    import torch

    lens = np.array([len(c) for c in contexts], dtype=np.int64)
    ends = np.cumsum(lens)
    tokens_N = np.concatenate(contexts).astype(np.int64)
    positions_N = np.arange(len(tokens_N)) - np.repeat(ends - lens, lens)
    parents_N = np.where(positions_N == 0, -1, np.arange(len(tokens_N)) - 1)
    plan = backend.attention_plan(parents_N, np.repeat(ends, lens), kernel="auto")
    dev = backend.device
    given_NW = None
    if capture is not None and known is not None:
        given_NW = np.concatenate([np.concatenate([k, np.full((n - len(k), k.shape[1]), -1,
                                                              np.int16)])
                                   for k, n in zip(known, lens)])
    with torch.no_grad():
        hidden_NH = backend.hidden_states(
            torch.from_numpy(tokens_N).to(dev), torch.from_numpy(positions_N).to(dev), plan,
            routes_NW=None if given_NW is None else torch.from_numpy(given_NW.astype(np.int64)
                                                                     ).to(dev))
        logits_GV = backend.module.project(hidden_NH[torch.from_numpy(ends - 1).to(dev)]).float()
        logp_GV = torch.log_softmax(logits_GV / temperature, dim=-1)
        ids_G = torch.multinomial(logp_GV.exp().cpu(), 1, generator=gen)[:, 0]
        lp_G = logp_GV.cpu().gather(-1, ids_G[:, None])[:, 0]
    routes = None
    if capture is not None:
        seen = capture[0]
        routes_NW = torch.cat([seen[i] for i in sorted(seen)], dim=-1).cpu().numpy()
        routes_NW = routes_NW.astype(np.int16)
        if given_NW is not None:  # the rows that ran replayed carry the routes they ran with
            routes_NW = np.where((given_NW >= 0).all(-1, keepdims=True), given_NW, routes_NW)
        routes = np.split(routes_NW, ends[:-1])
        seen.clear()
    return ids_G.numpy().astype(np.int32), lp_G.numpy().astype(np.float32), routes


def _sample_turns(backend, config, env, rng, gen, vocab, n_turns, contexts, calls, capture):
    """Sample every episode's calls turn by turn, tool outputs between them, into `calls`.

    An MoE model's routes are fixed per token at the first step that computes it (`known`,
    see _sample_step), so every step and every later call of an episode runs the same ones."""
    G = len(contexts)
    width = 0 if capture is None else backend.config.moe.route_width
    known = [np.zeros((0, width), np.int16) for _ in range(G)]
    for turn in range(max(n_turns)):
        live = [g for g in range(G) if turn < n_turns[g]]
        if turn:
            for g in live:  # the tool answered the previous call
                tool = env.tool(rng, config, vocab, contexts[g], turn - 1)
                contexts[g] = np.concatenate([contexts[g], np.asarray(tool, dtype=np.int32)])
        starts = {g: len(contexts[g]) for g in live}
        length = int(rng.integers(config.completion_tokens[0], config.completion_tokens[1] + 1))
        lps = {g: [] for g in live}
        routes = {}
        for _ in range(length):
            ids, lp, rt = _sample_step(backend, [contexts[g] for g in live], config.temperature,
                                       gen, capture, [known[g] for g in live])
            for k, g in enumerate(live):
                contexts[g] = np.append(contexts[g], ids[k])
                lps[g].append(lp[k])
                if rt is not None:   # the last step saw every token but the final sample
                    routes[g] = known[g] = rt[k]
        for g in live:
            call = {"token_ids": contexts[g].tolist(), "sampled_start": starts[g],
                    "generation_logprobs": lps[g]}
            if g in routes:   # the final sampled token never ran as an input: the -1 wildcard
                final = np.full((1, routes[g].shape[1]), -1, dtype=np.int16)
                call["routed_experts"] = np.concatenate([routes[g], final]).tolist()
            calls[g].append(call)


def sample_group(backend, config: Rollout, group: int, *, version: int = 0, producer: str = "rollout",
                 index_base: int = 0, env: Environment | None = None) -> pa.Table:
    """One GRPO group of sampled multi-turn episodes (EPISODE_SCHEMA rows), deterministic per group."""
    import torch

    env = _DEFAULT_ENV if env is None else env
    rng = np.random.default_rng([config.seed, group])
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    vocab = backend.config.vocab_size
    G = config.group_size
    prompt = np.asarray(env.prompt(rng, config, vocab), dtype=np.int32)
    n_turns = [int(rng.integers(config.turns[0], config.turns[1] + 1)) for _ in range(G)]
    contexts = [prompt.copy() for _ in range(G)]
    calls: list[list[dict]] = [[] for _ in range(G)]
    capture = _route_capture(backend)
    try:
        _sample_turns(backend, config, env, rng, gen, vocab, n_turns, contexts, calls, capture)
    finally:
        for handle in (capture[1] if capture else ()):
            handle.remove()
    reward = np.array([env.reward(calls[g], vocab) for g in range(G)], dtype=np.float32)
    adv = np.asarray(env.advantages(reward), dtype=np.float32)
    rows = [{"episode_id": f"{producer}-g{group}-e{g}", "group_id": f"{producer}-g{group}",
             "sample_index": index_base + group * G + g, "reward": float(reward[g]),
             "advantage": float(adv[g]), "weight_version": int(version), "calls": calls[g]}
            for g in range(G)]
    return validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA),
                             source=f"rollout {producer} group {group}", vocab_size=vocab)


_DEFAULT_ENV = Environment()


def run_rollout(queue, *, groups: int, config: Rollout = Rollout(), model: str = "tiny",
                device: str = "cpu", dtype: str = "float32", producer: str = "rollout",
                index_base: int = 0, rate: float | None = None, refit: bool = True,
                close: bool = True, put_timeout: float = 600.0, log=None,
                env: Environment | None = None, groups_per_step: int | None = None,
                max_lag: int | None = None, wait_timeout: float = 600.0) -> dict:
    """Sample `groups` groups into `queue` (one put per group), resuming after accepted puts.

    env: the task (prompts, tools, rewards, advantages; default the synthetic
    one). max_lag/groups_per_step: wait (at most wait_timeout s) before group
    g for published weights of version >= g // groups_per_step - max_lag.

    rate: episodes per second at most (None: as fast as sampling goes; a full
    queue blocks the producer). refit: load newer weights published on the
    queue before each group. close: close this producer at the end (the queue
    closes once every producer has, as its close_when says). The producer id
    is claimed first: one that a live producer holds is refused before any
    sampling.
    """
    if max_lag is not None and (groups_per_step is None or groups_per_step < 1 or max_lag < 0):
        raise ValueError(f"run_rollout(max_lag={max_lag}, groups_per_step={groups_per_step}): "
                         "give max_lag >= 0 with groups_per_step >= 1 (groups in a step)")
    start = queue.open_producer(producer)
    sampler = _Sampler(dtype=dtype, device=device)
    sampler.load(model)
    version, refits, put = 0, 0, 0
    t0 = time.perf_counter()
    for group in range(start, groups):
        if max_lag is not None and refit:
            _wait_for_version(queue, group // groups_per_step - max_lag, wait_timeout)
        published = queue.weights() if refit else None
        if published is not None and published[0] > version:
            sampler.load(published[1])
            version, refits = published[0], refits + 1
        elif sampler.backend is None:   # released at the last put, and no newer weights
            sampler.load(sampler.source)
        table = sample_group(sampler.backend, config, group, version=version, producer=producer,
                             index_base=index_base, env=env)
        if max_lag is not None and refit and group + 1 < groups:
            published = queue.weights()
            if (group + 1) // groups_per_step - max_lag > (published[0] if published else 0):
                sampler.release()   # the next group waits for the trainer's weights
            if (group + 1) % groups_per_step == 0:   # a step's last put: the trainer steps now
                sampler.note_wait()
        if rate:
            time.sleep(max(0.0, t0 + put / rate - time.perf_counter()))
        queue.put(table, producer=producer, seq=group, timeout=put_timeout)
        put += table.num_rows
        if log is not None:
            log(group, table, version)
    if close:
        queue.close(producer=producer)
    return {"groups": groups - start, "episodes": put, "resumed_at": start, "refits": refits,
            "weight_version": version, "seconds": round(time.perf_counter() - t0, 3),
            "sampler": sampler.figures()}


class _Sampler:
    """The producer's model: loaded one copy at a time, released while the trainer steps
    (see the module docstring's Memory), and what it held (`figures`)."""

    def __init__(self, *, dtype: str, device: str):
        self.dtype, self.device = dtype, device
        self.backend, self.source = None, None
        self.weights_bytes, self.held_while_waiting, self.releases, self.loads = 0, None, 0, 0

    def load(self, source) -> None:
        import torch

        from treeflow.models.backend import load_backend

        self.backend = None   # the old model goes before the new one loads
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        self.backend = load_backend("reference", source, dtype=dtypes[self.dtype],
                                    device=self.device)
        self.source, self.loads = source, self.loads + 1
        module = self.backend.module
        self.weights_bytes = int(sum(t.numel() * t.element_size()
                                     for t in (*module.parameters(), *module.buffers())))

    def release(self) -> None:
        """Drop the model (collected at once if a reference cycle holds it) and hand the
        process's cached device blocks back (CUDA), so the trainer (or another process on the
        card) can use them."""
        import gc
        import weakref

        model = None if self.backend is None else weakref.ref(self.backend.module)
        self.backend = None
        # dropping the last reference frees an acyclic model at once; a full collection (seconds
        # on a large heap, and it holds the GIL the trainer's thread needs) only when a reference
        # cycle keeps it alive
        if model is not None and model() is not None:
            gc.collect()
        if str(self.device).startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        self.releases += 1

    def note_wait(self) -> None:
        """The bytes held as the trainer takes the step just put (the largest over steps)."""
        held = 0 if self.backend is None else self.weights_bytes
        self.held_while_waiting = max(self.held_while_waiting or 0, held)

    def figures(self) -> dict:
        return {"weights_bytes": self.weights_bytes,
                "held_while_waiting_bytes": self.held_while_waiting,
                "releases": self.releases, "loads": self.loads}


def _wait_for_version(queue, need: int, timeout: float) -> None:
    """Block until the queue announces weights of version >= need (0 is the initial model)."""
    deadline = time.monotonic() + timeout
    while need > 0:
        published = queue.weights()
        if published is not None and published[0] >= need:
            return
        if queue.stats().get("closed"):
            from treeflow.tq import QueueClosed

            raise QueueClosed(f"the queue closed while the producer waited for weights v{need}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no weights of version >= {need} were published in {timeout:g} s; "
                               "is the trainer running (or raise wait_timeout)?")
        time.sleep(0.02)
