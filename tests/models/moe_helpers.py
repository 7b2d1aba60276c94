"""Tiny transformers MoE models and an independent route-forcing patch of their routers.

`hf_model(family)` builds a random Qwen3-MoE / Qwen2-MoE / Mixtral model with
transformers' own classes (weights large enough that routing is far from a
tie). `forced_routes(model, routes)` patches the *transformers* router
module's forward for the duration of a call so that its top-k indices are the
given ones and its weights the router's softmax probabilities at them,
normalised as that family normalises -- written here from transformers'
router code, not from treeflow's. `hf_call_routes` reads a call's own routes
off transformers' router logits.

The occurrence-logprob setup every MoE test compares lives here once, keyed alike
on both sides by (episode index, call, offset in the sampled span):
`hf_occurrence_logprobs` runs transformers call by call with the rows' routes
forced (any family's patch: the hybrids pass theirs), `occurrence_logprobs` runs
the same rows through treeflow (Pack -> Fragment -> Forward), and `hf_aux_and_nll`
is the router aux loss by hand.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from tests.deps import require
from tests.weights import as_loaded
from treeflow.ops import build_forward
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward, Fragment, Pack
from treeflow.stages.flat import list_offsets, list_values

transformers = require("transformers")

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
VOCAB = 61


def hf_config(family: str, **over):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  tie_word_embeddings=False)
    common.update(over)
    if family == "qwen3_moe":  # a dense layer in the middle (mlp_only_layers), renormalised top-k
        return transformers.Qwen3MoeConfig(**{**dict(num_experts=6, moe_intermediate_size=16,
                                                     norm_topk_prob=True, mlp_only_layers=[1],
                                                     head_dim=8), **common})
    if family == "qwen2_moe":  # shared expert; experts on every 2nd layer; top-k not renormalised
        return transformers.Qwen2MoeConfig(**{**dict(num_experts=6, moe_intermediate_size=16,
                                                     shared_expert_intermediate_size=24,
                                                     decoder_sparse_step=2), **common})
    return transformers.MixtralConfig(**{**dict(num_local_experts=5), **common})


def hf_model(family: str, seed: int = 0, **over):
    config = hf_config(family, **over)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def router_modules(model) -> list:
    """transformers' router module of each MoE layer, in layer order."""
    out = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            out.append(gate)
    return out


def _normalises(model) -> bool:
    # Qwen3.5-MoE's config has no norm_topk_prob: its router always renormalises
    return model.config.model_type == "mixtral" or bool(getattr(model.config, "norm_topk_prob",
                                                                True))


@contextlib.contextmanager
def forced_routes(model, routes_TW: np.ndarray | None):
    """Run `model` on one call (batch 1) with expert ids `routes_TW` [tokens, layers*top_k].

    A row of -1 keeps the router's own choice. The weights are softmax(router logits) at the
    forced ids, renormalised when the family renormalises its top-k.
    """
    if routes_TW is None:
        yield
        return
    gates = router_modules(model)
    k = gates[0].top_k
    norm = _normalises(model)
    mixtral = model.config.model_type == "mixtral"
    saved = []
    for j, gate in enumerate(gates):
        forced = torch.as_tensor(np.asarray(routes_TW[:, j * k:(j + 1) * k], np.int64))

        def forward(hidden_states, gate=gate, forced=forced):
            h = hidden_states.reshape(-1, gate.weight.shape[1])
            logits = F.linear(h, gate.weight)
            probs = torch.softmax(logits.float(), dim=-1)
            own = torch.topk(probs, k, dim=-1).indices
            idx = torch.where((forced >= 0).all(-1, keepdim=True), forced, own)
            top = probs.gather(1, idx)
            if norm:
                top = top / top.sum(-1, keepdim=True)
            return logits, (top if mixtral else top.to(logits.dtype)), idx

        saved.append((gate, gate.forward))
        gate.forward = forward
    try:
        yield
    finally:
        for gate, fwd in saved:
            gate.forward = fwd


def hf_call_routes(model, token_ids) -> np.ndarray:
    """The model's own routes for one call, [tokens, MoE layers * top_k] (sorted per layer)."""
    with torch.no_grad():
        out = model(torch.as_tensor([token_ids]), output_router_logits=True)
    k = router_modules(model)[0].top_k
    per_layer = [torch.topk(torch.softmax(lg.float(), -1), k, dim=-1).indices.sort(-1).values
                 for lg in out.router_logits]
    return torch.cat(per_layer, dim=-1).numpy().astype(np.int16)


def hf_call_logprobs(model, token_ids, sampled_start, routes_TW=None, *,
                     forced=forced_routes) -> torch.Tensor:
    """Logprobs of the call's sampled tokens, the call alone through transformers (`forced`:
    the family's route-forcing patch)."""
    t = torch.as_tensor([token_ids])
    with forced(model, routes_TW):
        logits = model(t).logits[0].float()
    logp = torch.log_softmax(logits[sampled_start - 1:-1], -1)
    return logp.gather(-1, t[0, sampled_start:, None])[:, 0]


def episodes(rng: np.random.Generator, *, groups: int = 2, per_group: int = 2, turns: int = 3):
    """Append-only agent episodes in GRPO groups (a shared prompt, branching completions)."""
    rows = []
    for g in range(groups):
        prompt = rng.integers(1, VOCAB, 5).tolist()
        for e in range(per_group):
            seq, calls = list(prompt), []
            for _ in range(turns):
                start = len(seq)
                seq = seq + rng.integers(1, VOCAB, int(rng.integers(2, 4))).tolist()
                calls.append({"token_ids": list(seq), "sampled_start": start})
                seq = seq + rng.integers(1, VOCAB, 2).tolist()  # tool result
            rows.append({"episode_id": f"g{g}e{e}", "group_id": f"g{g}", "calls": calls,
                         "sample_index": len(rows)})
    return rows


def with_routes(model, rows, *, shift: int = 0, sentinel: bool = True):
    """Rows with each call's own routes (+shift mod experts: a perturbation), NeMo-Gym style:
    the final sampled token's route is the sentinel -1."""
    experts = router_modules(model)[0].num_experts
    out = []
    for row in rows:
        calls = []
        for c in row["calls"]:
            r = hf_call_routes(model, c["token_ids"]).astype(np.int64)
            r = (r + shift) % experts
            if sentinel:
                r[-1] = -1
            calls.append({**c, "routed_experts": r.tolist()})
        out.append({**row, "calls": calls})
    return out


def hf_occurrence_logprobs(model, rows, *, replay: bool = True, forced=forced_routes) -> dict:
    """{(episode index, call, offset): logprob tensor} of every sampled token, transformers call
    by call, with each call's routes forced into its routers by `forced` when `replay`."""
    out = {}
    for i, row in enumerate(rows):
        for k, c in enumerate(row["calls"]):
            routes = np.asarray(c["routed_experts"]) if replay else None
            lp = hf_call_logprobs(model, c["token_ids"], c["sampled_start"], routes, forced=forced)
            out.update({(i, k, j): v for j, v in enumerate(lp)})
    return out


def occurrence_oracle(model, rows, *, forced=forced_routes) -> dict:
    """{(episode, call, token): logprob} of every sampled token, transformers call by call with
    the rows' routes forced into its routers by `forced`."""
    with torch.no_grad():
        return {key: float(v) for key, v in hf_occurrence_logprobs(model, rows,
                                                                   forced=forced).items()}


_OCC = ("occ_sample_index", "occ_call", "occ_offset", "occ_edge")


def occurrence_logprobs(model, rows, *, layout: str, routing: str, max_tokens: int = 40,
                        scope: str | None = None, dims=None, **forward):
    """({(episode index, call, offset): logprob tensor}, runner, bins): the rows (dicts, or a
    validated episode table) through
    Pack(layout, scope) -> Fragment(max_tokens) -> Forward(routing, **forward) built on `model`
    (a Decoder or a backend), split as `dims` (a ParallelDims), bin by bin; the runner's route
    tally counts this run only."""
    table = rows if isinstance(rows, pa.Table) else validate_episodes(
        pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    bins = Fragment(max_tokens=max_tokens)(Pack(layout=layout, scope=scope)(table))
    runner = build_forward(Forward(routing=routing, **forward), model=model, dims=dims)
    runner.take_route_tally()
    prepared = runner.prepare(bins)
    cols = {n: bins.column(n).combine_chunks() for n in _OCC}
    off, vals = list_offsets(cols["occ_edge"]), {n: list_values(c) for n, c in cols.items()}
    out = {}
    for r, item in enumerate(prepared.items):
        if item is None:
            continue
        lp_E, _ = runner.run_bin(item)
        for o in range(off[r], off[r + 1]):
            key = tuple(int(vals[n][o]) for n in _OCC[:3])
            assert key not in out
            out[key] = lp_E[int(vals["occ_edge"][o])]
    return out, runner, bins


def hf_aux_and_nll(hf, rows, *, routers=router_modules, forced=forced_routes):
    """-token-mean logprob + coef x Switch aux (transformers' load_balancing_loss_func over
    every call's input rows) by hand, with each call's routes forced into its routers
    (`routers`, `forced`: the family's router modules and route-forcing patch)."""
    coef, experts = hf.config.router_aux_loss_coef, routers(hf)[0].num_experts
    nll, n_tok, mass, counts, w = 0.0, 0, torch.zeros(experts), torch.zeros(experts), 0
    for row in rows:
        for c in row["calls"]:
            t = torch.as_tensor([c["token_ids"]])
            routes = np.asarray(c["routed_experts"])
            with forced(hf, routes):
                out = hf(t, output_router_logits=True)
            logp = torch.log_softmax(out.logits[0].float()[c["sampled_start"] - 1:-1], -1)
            nll = nll - logp.gather(-1, t[0, c["sampled_start"]:, None]).sum()
            n_tok += t.shape[1] - c["sampled_start"]
            n = t.shape[1] - 1  # input rows that predict a token
            for logits in out.router_logits:
                mass = mass + torch.softmax(logits[:n].float(), -1).sum(0)
            counts += torch.bincount(torch.as_tensor(routes[:n]).reshape(-1), minlength=experts)
            w += n * len(out.router_logits)
    return nll / n_tok + coef * experts * (counts * mass).sum() / w ** 2


def gpu_error_bound(hf, rows, dtype: str, tol32: float, bf16_slack: float, *,
                    forced=forced_routes):
    """(want, error, bound) for a GPU run against float32 transformers on the CPU: error is the
    max over tokens in float32 and the mean in bf16, where the bound is `bf16_slack` times
    transformers' own bf16 error on the same calls (tiny random models have no fixed bf16 bound)."""
    want = occurrence_oracle(hf, rows, forced=forced)

    def error(got: dict) -> float:
        d = [abs(float(got[key]) - want[key]) for key in want]
        return max(d) if dtype == "float32" else sum(d) / len(d)

    if dtype == "float32":
        return want, error, tol32
    bound = bf16_slack * error(occurrence_oracle(as_loaded(hf, torch.bfloat16), rows,
                                                 forced=forced))
    as_loaded(hf, torch.float32)  # RoPE frequencies were never cast: the oracle is intact
    return want, error, bound
