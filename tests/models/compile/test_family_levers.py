"""Tuning's recompute (every mode) and, for gpt-oss, compiled layers on the families with
sliding windows, attention sinks and Gated DeltaNet layers (issue 51): Gemma 3, gpt-oss,
Qwen3-Next, Qwen3.5, Qwen3.5-MoE.

A checkpointed layer (or half of one) reruns the same ops in backward, so on CPU the logprobs
and every parameter gradient equal the plain path's bit for bit (torch.equal), and
transformers' own class call by call in float32 (1e-5 absolute on logprobs, 1e-5 of each
tensor's largest entry on gradients, as family_checks.py; the GDN families' gradients in
float64 against transformers' float64 run, 1e-5 relative, as test_qwen3_next.py: in float32
A_log's and dt_bias's differ by up to 1.4e-5 relative, sums in another order). Trees in fragments of a 24-token
budget, GRPO groups; MoE families replay routes shifted off the routers' own choice (forced
into transformers' routers), so a route re-decided in backward would move the expert
gradients. Each run also counts the calls of every layer's two norms that open its halves:
a recomputed half runs twice, so a mode that silently ran the plain path fails here. Planted
by hand (see the report of issue 51): a rerun in backward that drops Gemma 3's window failed
selective, full and attention (the MLP half holds no attention); one that drops gpt-oss's
sinks failed those and the compiled layers under selective; "attention" run plainly failed
the norm counts.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.models.families_helpers import hf_gemma3, hf_gpt_oss
from tests.models import hybrid_moe_helpers, moe_helpers
from tests.models.hybrid_moe_helpers import tf_values
from tests.models.hybrid_helpers import token_weights
from tests.models.moe_helpers import episodes, hf_occurrence_logprobs
from tests.models.qwen3_next_helpers import hf_qwen3_next
from treeflow.models import Tuning, load_backend
from treeflow.models.config.moe import route_width
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.stages import Forward

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

MAKERS = {"gemma3": hf_gemma3, "gpt_oss": hf_gpt_oss,
          **{f: functools.partial(hf_qwen3_next, family=f)
             for f in ("qwen3_next", "qwen3_5", "qwen3_5_moe")}}
MODES = ("selective", "full", "attention", "mlp")
# how many times each half's opening norm runs per bin in forward + backward
HALVES = {"none": (1, 1), "selective": (2, 2), "full": (2, 2), "attention": (2, 1),
          "mlp": (1, 2)}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def family(request, tmp_path_factory):
    """(path, rows, routing, weights, transformers' values and gradients, the plain path's)."""
    from treeflow.models import ModelConfig

    hf = MAKERS[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    rows = episodes(np.random.default_rng(3))  # 2 GRPO groups of 2, 3 calls each
    moe = route_width(ModelConfig.from_hf_dir(str(path))) is not None
    # each family's route capture and forcing patch: gpt-oss's router returns no top_k module
    helpers = hybrid_moe_helpers if request.param == "gpt_oss" else moe_helpers
    if moe:
        rows = helpers.with_routes(hf, rows, shift=1)
    routing = "replay" if moe else "auto"
    keys = [(i, k, j) for i, r in enumerate(rows) for k, c in enumerate(r["calls"])
            for j in range(len(c["token_ids"]) - c["sampled_start"])]
    w = {key: 0.5 + (n % 7) / 7 for n, key in enumerate(keys)}
    hf.zero_grad()
    lp = hf_occurrence_logprobs(hf, rows, replay=moe, forced=helpers.forced_routes)
    sum(w[k] * v for k, v in lp.items()).backward()
    want = {k: float(v.detach()) for k, v in lp.items()}
    want_grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    plain = _run(path, rows, w, routing, Tuning())
    out = dict(path=path, rows=rows, routing=routing, w=w, want=want, want_grads=want_grads,
               plain=plain, gdn=request.param.startswith("qwen3"))
    if out["gdn"]:  # gradients against transformers in float64 (test_qwen3_next.py's oracle)
        from tests.models.reference.test_qwen3_next import _hf64_values

        eps = validate_episodes(pa.Table.from_pylist(episodes(np.random.default_rng(3)),
                                                     schema=EPISODE_SCHEMA))
        out["eps"], out["w64"] = eps, token_weights(eps)
        with pytest.MonkeyPatch.context() as mp:
            out["want64"] = _hf64_values(hf, eps, out["w64"], mp)
    return out


def _run(path, rows, w, routing, tuning):
    """(logprobs, gradients, {half: calls of its opening norm per layer and bin}) of the tree
    layout in fragments, through the backend loaded with `tuning` (compiled layers: no counts,
    a hook would be traced into their graphs)."""
    backend = load_backend("reference", str(path), tuning=tuning)
    calls = {"attention": 0, "mlp": 0}
    layers = backend.module.layers
    for layer in () if tuning.compile_layers else layers:
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) \
            or layer.post_attention_layernorm
        for half, norm in (("attention", layer.input_layernorm), ("mlp", mlp_norm)):
            norm.register_forward_hook(lambda *_, h=half: calls.__setitem__(h, calls[h] + 1))
    vals, grads, bins, _ = tf_values(backend, rows, w, layout="tree", max_tokens=24,
                                     routing=routing, kernel="auto")
    assert bins > 2  # fragments: several bins, context repeated
    per = len(layers) * bins
    return vals, grads, {h: n / per for h, n in calls.items()}


def _check(family, tuning, mode):
    vals, grads, calls = _run(family["path"], family["rows"], family["w"], family["routing"],
                              Tuning.parse(tuning))
    pvals, pgrads, pcalls = family["plain"]
    assert pcalls == dict(zip(("attention", "mlp"), HALVES["none"]))
    if not Tuning.parse(tuning).compile_layers:
        assert calls == dict(zip(("attention", "mlp"), HALVES[mode])), calls
    want, want_grads = family["want"], family["want_grads"]
    assert vals.keys() == want.keys()
    assert max(abs(vals[k] - want[k]) for k in want) < 1e-5
    assert grads.keys() == want_grads.keys()
    if family["gdn"]:  # float32 GDN gradients differ from transformers' by up to 1.4e-5
        from tests.models.reference.test_qwen3_next import _check as check64, _ours64_values

        v64, g64, bins = _ours64_values(family["path"], family["eps"], family["w64"],
                                        fork="chunk", layout="tree", max_tokens=24,
                                        recompute=mode)
        assert bins > 2
        check64(*family["want64"][:1], v64, family["want64"][1], g64, tol=1e-6)
        return vals, grads, pvals, pgrads
    for n, g in want_grads.items():
        assert float((grads[n] - g).abs().max()) <= 1e-5 * float(g.abs().max()), n
    return vals, grads, pvals, pgrads


@pytest.mark.parametrize("mode", MODES)
def test_recompute_equals_the_plain_path_bit_for_bit_and_transformers(family, mode):
    vals, grads, pvals, pgrads = _check(family, f"recompute={mode}", mode)
    assert vals == pvals  # the same floats
    assert grads.keys() == pgrads.keys()
    assert not [n for n in pgrads if not torch.equal(grads[n], pgrads[n])]


@pytest.mark.parametrize("family", ["gpt_oss"], indirect=True)
@pytest.mark.parametrize("tuning,mode", [("compile_layers=1,compile_backend=aot_eager", "none"),
                                         ("compile_layers=1,compile_backend=aot_eager,"
                                          "recompute=selective", "selective")])
def test_gpt_oss_compiled_layers_equal_transformers(family, tuning, mode):
    """gpt-oss's layers run through compile/layer_ops.py's compiled parts (traced with
    aot_eager on CPU); its sinks enter at the attention call, outside them."""
    _check(family, tuning, mode)


@pytest.mark.parametrize("maker", ["gemma3", "qwen3_5"])
def test_compiled_layers_are_refused_in_one_line_saying_why(maker, tmp_path):
    MAKERS[maker]().save_pretrained(tmp_path)
    tuning = Tuning(compile_layers=True, compile_backend="aot_eager", recompute="full")
    name, why = {"gemma3": ("Gemma 3", "post-norms"),
                 "qwen3_5": ("Qwen3.5", "Gated DeltaNet layers")}[maker]
    line = rf"{name} \(.*\): compiled layers .* are not supported: .*{why}.*leave compile_layers"
    for refuse in (lambda: Forward(model=str(tmp_path), tuning=tuning).check_model(),
                   lambda: load_backend("reference", str(tmp_path), tuning=tuning)):
        with pytest.raises(ValueError, match=line) as e:
            refuse()
        assert "\n" not in str(e.value)
    load_backend("reference", str(tmp_path), tuning=Tuning(recompute="full"))  # accepted


def test_recompute_auto_runs_what_it_picks_for_gemma3(tmp_path, capsys):
    """`--recompute auto` (training's default) picks a recompute mode where the plan does not
    fit the card without one; for Gemma 3 it picked full and the backend then refused it (the
    run died). A 40 MiB card makes it pick; the step runs."""
    from treeflow.cli import main
    from treeflow.tools import synth_episodes, write_episodes

    hf_gemma3().save_pretrained(tmp_path / "m")
    write_episodes(synth_episodes(episodes=4, group_size=2, vocab_size=61, seed=0),
                   tmp_path / "e.arrow")
    assert main(["replay", str(tmp_path / "e.arrow"), "--model", str(tmp_path / "m"),
                 "--mode", "train", "--loss", "nll", "--episodes-per-step", "2", "--steps", "1",
                 "--max-tokens", "4096", "--device-memory", "40MiB", "--quiet",
                 "-o", str(tmp_path / "o.arrow")]) == 0
    assert "--recompute auto: full" in capsys.readouterr().err
