"""--shard-params (FSDP2, train/fsdp.py) on recurrent hybrids under context parallelism: two gloo
processes on CPU (DP=1 x CP=2), float32; Nemotron-H (Mamba-2) and Qwen3.5 (Gated DeltaNet).

The ranks used to deadlock here, and the cause was not the Mamba-2 exchange (models/ssm/cp.py):
the root FSDP2 group runs two forward calls per bin (the decoder and the vocabulary projection,
Decoder.selected_logprobs), and each has its own post-backward. A context-parallel rank that owns
no edge of a bin tied its empty logprobs to the hidden rows only, so its untied output weight got
no gradient there and its post-backward skipped the reduce-scatter that the rank with edges ran;
the two then met in different collectives (one's reduce-scatter, the other's next all-gather).
Nemotron-H's head is untied; the tiny attention decoder's is tied, so its gradient waits for the
embedding's on every rank, which is why attention decoders seemed to shard under CP already: a
Llama with an untied head deadlocked the same way (the third case here; gloo's timeout with
the old code, tried). The rows
below (a GRPO group whose prompt ends inside a scan chunk -- 9 tokens, chunk 4; for GDN 65,
chunk 64 -- fragments of 24 (80) tokens and whole trees of 512) include bins where one rank
owns no edge (counted: the test fails if none).

Each bin runs forward and backward on its own, as a training step does (one backward over every
bin did not deadlock: the head's gradient then waited for the last bin on both ranks). Each
sharded run's logprobs equal the unsharded CP=2 run's bit for bit (the same forward), every
gathered parameter gradient to 1e-6 relative per tensor (a reduce-scatter per bin against one
all-reduce of the accumulated sums: the same float32 terms added in another order; measured
8.5e-8 at most), and both equal transformers call by call (Nemotron-H and the Llama: float32,
test_fsdp_hybrid.py's bounds; Qwen3.5: float64, test_fsdp_gdn.py's). The
process group's timeout is short, so a deadlock fails the test within TIMEOUT_S instead of
gloo's default 600 s.

One spawn of two ranks runs every family (`spawned`, one process group; each family's results are
its own entry, so a failure names the family): a spawn's start (torch, transformers, the process
group) cost as much as a family's runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.deps import require
from tests.models.hybrid_helpers import HF_MAMBA_SEMANTICS
from treeflow.train.launch import spawn

require("transformers", min_version="5.25", why=HF_MAMBA_SEMANTICS)

# one xdist worker runs the module: its cases share one spawn (a module fixture), which a
# second worker would start again
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("test_fsdp_hybrid_cp")]

TIMEOUT_S = 60  # the process group's: a rank stuck in a collective fails within it
HF_ABS, HF_REL = 1e-5, 1e-5
CP_REL = 1e-6  # test_hybrid_context_parallel.py's CP-vs-one-process bound; measured 8.5e-8
OCC = ("occ_sample_index", "occ_call", "occ_offset", "occ_edge")


def _name(family, hf_name):
    return hf_name.replace("model.", "backbone.", 1) if family == "nemotron_h" else hf_name


def _cp_rank(cases):
    """For every family of `cases` ({family: (checkpoint, rows, weights, budgets)}): the
    unsharded run, then the sharded one, all in one process group (a spawn of two ranks
    costs their start -- torch, transformers, the group -- as much as a family's runs)."""
    import treeflow.models.heads.logprobs as heads
    from treeflow.parallel import ParallelDims
    from treeflow.train import DataParallel

    dims = ParallelDims(cp=2)
    dp = DataParallel.from_env("cpu", dims=dims, timeout_s=TIMEOUT_S)
    inner = heads.selected_logprobs
    try:
        out = {family: {shard: _cp_run(path, rows, weights, shard, budgets, dims)
                        for shard in (False, True)}
               for family, (path, rows, weights, budgets) in cases.items()}
    finally:
        heads.selected_logprobs = inner
    dp.close()
    return out


def _cp_run(path, rows, weights, shard, budgets, dims):
    """Per budget: the group's occurrence logprobs and gradient of sum(w * logprob), and how
    many bins this rank ran without an edge."""
    import pyarrow as pa
    import torch.distributed as dist

    import treeflow.models.heads.logprobs as heads
    from treeflow.models import load_backend
    from treeflow.ops import build_forward
    from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
    from treeflow.stages import Forward, Fragment, Pack
    from treeflow.stages.flat import list_offsets, list_values
    from treeflow.train.fsdp import shard_module

    backend = load_backend("reference", path)
    if shard:
        shard_module(backend.module, torch.float32)
    empty, inner = [0], heads.selected_logprobs

    def counted(model, hidden_EH, *a, **k):  # counts the bins where this rank owns no edge
        empty[0] += len(hidden_EH) == 0
        return inner(model, hidden_EH, *a, **k)

    heads.selected_logprobs = counted
    table = validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
    out = {}
    for budget in budgets:
        backend.module.zero_grad(set_to_none=True)
        empty[0] = 0
        bins = Fragment(max_tokens=budget)(Pack(layout="tree", scope="group")(table))
        runner = build_forward(Forward(), model=backend, dims=dims)
        cols = {n: list_values(bins.column(n).combine_chunks()) for n in OCC}
        off = list_offsets(bins.column("occ_edge").combine_chunks())
        lp = {}
        for r, item in enumerate(runner.prepare(bins).items):
            assert item is not None  # every rank of the group runs every bin
            lp_E, _ = runner.run_bin(item)
            occ = {tuple(int(cols[n][o]) for n in OCC[:3]): int(cols["occ_edge"][o])
                   for o in range(off[r], off[r + 1])}
            # forward and backward bin by bin, as a training step runs them
            sum(weights[k] * lp_E[e] for k, e in occ.items()).backward()
            lp.update({k: lp_E[e].detach() for k, e in occ.items()})
        keys = sorted(lp)
        values = torch.stack([lp[k].detach() for k in keys])
        dist.all_reduce(values)  # each edge is held by one rank, zero on the other
        grads = {}
        for n, p in backend.module.named_parameters():
            if shard:  # reduce-scattered (a SUM over both ranks), gathered whole
                grads[n] = p.grad.full_tensor()
            else:
                grads[n] = p.grad.detach().clone()
                dist.all_reduce(grads[n])
        out[budget] = {"keys": keys, "values": values, "grads": grads, "empty": empty[0]}
    heads.selected_logprobs = inner
    return out


FAMILIES = ("nemotron_h", "qwen3_5", "llama_untied")


def _build(family, tmp_path_factory):
    """(transformers model, checkpoint, episodes, token weights, budgets)."""
    from tests.models.hybrid_helpers import episodes, save_hf, token_weights

    path = tmp_path_factory.mktemp(family) / "m"
    if family == "llama_untied":  # the cause alone: an attention decoder, untied head
        import transformers

        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)).eval()
        hf.save_pretrained(path)
        eps = episodes(9, seed=9)
        return hf, str(path), eps, token_weights(eps), (24, 512)
    if family == "nemotron_h":
        hf = save_hf("nemotron_h", path)
        eps = episodes(9, seed=9)
        return hf, str(path), eps, token_weights(eps), (24, 512)
    from tests.models.qwen3_next_helpers import VOCAB, hf_qwen3_next

    hf = hf_qwen3_next(family=family)
    hf.save_pretrained(path)
    eps = episodes(65, seed=65, vocab=VOCAB)
    return hf, str(path), eps, token_weights(eps), (80, 512)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return {family: _build(family, tmp_path_factory) for family in FAMILIES}


@pytest.fixture(scope="module")
def spawned(built):
    """The two ranks' results of _cp_rank for every family: one spawn."""
    cases = {family: (path, eps.to_pylist(), weights, budgets)
             for family, (_, path, eps, weights, budgets) in built.items()}
    return spawn(_cp_rank, 2, cases, timeout_s=8 * TIMEOUT_S * len(cases), threads=1)


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request, built, monkeypatch_module):
    """(family, checkpoint, rows, weights, budgets, the oracle's values and gradients, its
    logprob and gradient bounds). Nemotron-H: transformers in float32 (test_fsdp_hybrid.py's
    bounds); Qwen3.5 (Gated DeltaNet): transformers in float64 (test_fsdp_gdn.py's oracle and
    bounds: float32 GDN gradients sit up to 1.4e-5 from transformers' float32 ones)."""
    from tests.models.hybrid_helpers import hf_values

    family = request.param
    hf, path, eps, weights, budgets = built[family]
    if family != "qwen3_5":
        return (family, path, eps.to_pylist(), weights, budgets, hf_values(hf, eps, weights),
                (HF_ABS, HF_REL))
    from tests.train.test_fsdp_gdn import GRAD64_REL, LP64_ABS, _hf64

    return (family, path, eps.to_pylist(), weights, budgets,
            _hf64(hf, eps, weights, monkeypatch_module), (LP64_ABS, GRAD64_REL))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_sharded_hybrid_cp2_equals_unsharded_cp2_and_transformers(hybrid, spawned):
    family, path, rows, weights, budgets, (hf_vals, hf_grads), (lp_abs, grad_rel) = hybrid
    runs = [rank[family] for rank in spawned]
    plain, sharded = [r[False] for r in runs], [r[True] for r in runs]
    # the case of the deadlock: a bin where one rank owns no edge
    assert sum(run[b]["empty"] for run in sharded for b in budgets) > 0
    for run, ref in zip(sharded, plain):
        for b in budgets:
            got, want = run[b], ref[b]
            assert got["keys"] == want["keys"] and set(got["keys"]) == set(hf_vals)
            assert torch.equal(got["values"], want["values"]), b
            worst = max(abs(float(v) - hf_vals[k]) for k, v in zip(got["keys"], got["values"]))
            assert worst < lp_abs, (b, worst)
            assert got["grads"].keys() == want["grads"].keys()
            for n, g in got["grads"].items():  # per-bin reduce-scatters vs one all-reduce
                rel = float((g - want["grads"][n]).norm() / want["grads"][n].norm())
                assert rel < CP_REL, (b, n, rel)
            assert {_name(family, n) for n in hf_grads} == got["grads"].keys()
            for n, g in hf_grads.items():
                ours = got["grads"][_name(family, n)].double()
                rel = float((ours - g.double()).norm() / g.norm().clamp_min(1e-12))
                assert rel < grad_rel, (b, n, rel)
