"""The megatron-core backend gives the reference backend's and transformers' numbers (CPU, fp32).

Tiny Llama (untied, no bias) and Qwen2 (tied, QKV bias) checkpoints written
by transformers; episodes replayed as tree, chain and exact layouts through
the real stages with backend="megatron" and backend="reference"; a training
step's loss and gradients compared after mapping reference gradients to
MCore's names and layouts; the exported checkpoint loaded by transformers.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                    "pip install 'treeflow[megatron]' to run the megatron backend tests")
transformers = pytest.importorskip("transformers")

from models_helpers import hf_call_logprobs  # noqa: E402

from tests.weights import perturb  # noqa: E402
from treeflow.models import load_backend  # noqa: E402
from treeflow.models.megatron import hf_to_mcore, mcore_to_hf, shard, unshard  # noqa: E402
from treeflow.pipeline import Pipeline  # noqa: E402
from treeflow.tools import synth_episodes
from treeflow.stages import Forward, Fragment, Loss, Pack, Reassemble, Reduce  # noqa: E402
from treeflow.train import Trainer  # noqa: E402

# each test tears down the group the backend makes (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("megatron_group")

VOCAB = 256
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
MODELS = {"llama": False, "qwen2": True}  # tied?


def _write_hf(kind: str, path):
    torch.manual_seed(0)
    tied = MODELS[kind]
    if kind == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **SHAPE, rope_theta=500000.0, tie_word_embeddings=tied))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **SHAPE, rope_theta=10000.0, tie_word_embeddings=tied))
    perturb(hf, scale=3.0).eval().save_pretrained(path, safe_serialization=True)
    return hf


@pytest.fixture(scope="module", params=sorted(MODELS))
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), _write_hf(request.param, path)


def _episodes(seed=5):
    return synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=20,
                          user_tokens=(3, 6), completion_tokens=(3, 7), tool_tokens=(3, 6),
                          branch_prob=0.3, vocab_size=VOCAB, seed=seed)


def _replay(model_dir, backend, layout, kernel="auto", entropy=False):
    pipe = Pipeline(Pack(layout=layout), Fragment(max_tokens=96),
                    Forward(model=model_dir, backend=backend, kernel=kernel, entropy=entropy),
                    Reassemble(entropy=entropy))
    return pa.concat_tables([r.output for r in pipe.run(_episodes())])


def _flat(table, column="logprobs"):
    return np.concatenate([np.asarray(c, dtype=np.float64) for ep in table.column(column).to_pylist()
                           for c in ep])


@pytest.mark.parametrize("layout", ["tree", "chain", "exact"])
def test_logprobs_equal_reference_and_transformers(ckpt, layout):
    path, hf = ckpt
    meg = _flat(_replay(path, "megatron", layout))
    ref = _flat(_replay(path, "reference", layout))
    want = hf_call_logprobs(hf, _episodes())
    assert meg.shape == ref.shape == want.shape and np.abs(want).mean() > 1.0
    np.testing.assert_allclose(meg, ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(meg, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel", ["dense", "flex", "runs"])
def test_every_kernel_and_entropies(ckpt, kernel):
    path, _ = ckpt
    meg = _replay(path, "megatron", "tree", kernel=kernel, entropy=True)
    ref = _replay(path, "reference", "tree", kernel=kernel, entropy=True)
    for column in ("logprobs", "entropies"):
        np.testing.assert_allclose(_flat(meg, column), _flat(ref, column), rtol=0, atol=1e-5)


def _step(path, backend, episodes):
    trainer = Trainer(Forward(model=path, backend=backend),
                      Reduce(loss=Loss(kind="pg", norm="seq-mean", clip_low=0.2, clip_high=0.28),
                             max_grad_norm=0.005))
    step = trainer.open_step(episodes)
    step.add(Fragment(max_tokens=96)(Pack(layout="tree")(episodes)))
    grads = {n: p.grad.detach().clone() for n, p in trainer.backend.named_parameters()}
    return trainer, step, grads


def test_training_step_matches_reference(ckpt, tmp_path):
    path, _ = ckpt
    eps = _episodes(seed=8)
    eps = eps.set_column(eps.schema.get_field_index("advantage"), "advantage",
                         pa.array(np.linspace(-1, 1, eps.num_rows), pa.float32()))
    meg, meg_step, meg_grads = _step(path, "megatron", eps)
    ref, ref_step, ref_grads = _step(path, "reference", eps)
    assert meg_step.loss_sum == pytest.approx(ref_step.loss_sum, rel=1e-5, abs=0)
    mapped = hf_to_mcore(ref_grads, ref.backend.config)
    assert mapped.keys() == meg_grads.keys()
    for name, g in meg_grads.items():
        scale = float(mapped[name].abs().max())
        assert scale > 0, name
        assert float((g - mapped[name]).abs().max()) <= 1e-5 * scale, name
    meg_metrics, ref_metrics = meg_step.finish().to_pylist()[0], ref_step.finish().to_pylist()[0]
    assert meg_metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
    assert ref_metrics["grad_norm"] > 0.005  # so the clipping was exercised
    # after AdamW the exported weights are the reference's
    # Trainer.save returns its step directory, a Hugging Face model directory
    a = transformers.AutoModelForCausalLM.from_pretrained(meg.save(tmp_path / "meg")).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(ref.save(tmp_path / "ref")).state_dict()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


def test_export_loads_in_transformers_with_the_same_logprobs(ckpt, tmp_path):
    path, hf = ckpt
    backend = load_backend("megatron", path)
    backend.save(tmp_path)
    from safetensors.torch import load_file
    exported, original = load_file(tmp_path / "model.safetensors"), hf.state_dict()
    assert ("lm_head.weight" in exported) == (not hf.config.tie_word_embeddings)
    for name, value in exported.items():
        assert torch.equal(value, original[name]), name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(hf)
    np.testing.assert_allclose(_flat(_replay(str(tmp_path), "megatron", "tree")),
                               hf_call_logprobs(back, _episodes()), rtol=0, atol=1e-5)


def test_conversion_round_trips_and_shards():
    from treeflow.models import ModelConfig
    c = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                    architecture="Qwen2ForCausalLM")
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,),
              "lm_head.weight": (16, 8)}
    layer = "model.layers.0."
    for x, rows in (("q", 8), ("k", 4), ("v", 4)):
        shapes[f"{layer}self_attn.{x}_proj.weight"] = (rows, 8)
        shapes[f"{layer}self_attn.{x}_proj.bias"] = (rows,)
    shapes.update({f"{layer}self_attn.o_proj.weight": (8, 8), f"{layer}mlp.gate_proj.weight": (12, 8),
                   f"{layer}mlp.up_proj.weight": (12, 8), f"{layer}mlp.down_proj.weight": (8, 12),
                   f"{layer}input_layernorm.weight": (8,),
                   f"{layer}post_attention_layernorm.weight": (8,)})
    hf = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    mc = hf_to_mcore(hf, c)
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.weight"]  # group 0: q0 q1 k0 v0 (D=2)
    q, k, v = (hf[f"{layer}self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(qkv[:8], torch.cat([q[:4], k[:2], v[:2]]))
    assert torch.equal(qkv[8:], torch.cat([q[4:], k[2:], v[2:]]))
    back = mcore_to_hf(mc, c)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    parts = [shard(mc, r, 2) for r in range(2)]
    fc1 = parts[1]["decoder.layers.0.mlp.linear_fc1.weight"]  # rank 1: [gate rows 6:12; up rows 6:12]
    gate, up = hf[f"{layer}mlp.gate_proj.weight"], hf[f"{layer}mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[6:], up[6:]]))
    assert torch.equal(parts[1]["decoder.layers.0.self_attention.linear_qkv.weight"], qkv[8:])
    full = unshard(parts)
    assert all(torch.equal(full[k], mc[k]) for k in mc)


def test_refusals():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from treeflow.models import ModelConfig
    from treeflow.models.megatron import MegatronBackend, build_gpt_model
    from treeflow.models.megatron.parallel import init_parallel

    init_parallel(1, torch.device("cpu"))
    c = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    tree = build_gpt_model(c)
    causal = GPTModel(tree.config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                      vocab_size=32, max_sequence_length=64, position_embedding_type="rope")
    with pytest.raises(ValueError, match="ordinary causal attention over a tree"):
        MegatronBackend(causal, c)
    tree.mtp_process = True  # what GPTModel(mtp_block_spec=...) sets
    with pytest.raises(ValueError, match="multi-token-prediction heads are not supported"):
        MegatronBackend(tree, c)
    with pytest.raises(TypeError, match="hybrid/Mamba models are refused"):
        MegatronBackend(torch.nn.Linear(2, 2), c)
    with pytest.raises(ValueError, match="already set up with tensor parallelism 1, not 2"):
        load_backend("megatron", "tiny", tensor_parallel=2)
    with pytest.raises(ValueError, match="sequence_parallel=True needs CUDA"):
        load_backend("megatron", "tiny", sequence_parallel=True)
    backend = MegatronBackend(build_gpt_model(c), c)
    with pytest.raises(TypeError, match="needs the bin's AttentionPlan"):  # e.g. a causal mask
        backend.module.decoder(hidden_states=torch.zeros(4, 1, 16),
                               attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool).triu(1))


def test_cli_replay_and_train_with_the_megatron_backend(ckpt, tmp_path, capsys):
    import json

    from treeflow.cli import main
    from treeflow.tools import write_episodes

    path, hf = ckpt
    data = tmp_path / "e.arrow"
    write_episodes(_episodes(), data)
    assert main(["replay", str(data), "--backend", "megatron", "--model", path,
                 "-o", str(tmp_path / "lp.arrow"), "--json"]) == 0
    got = _flat(pa.ipc.open_file(tmp_path / "lp.arrow").read_all())
    np.testing.assert_allclose(got, hf_call_logprobs(hf, _episodes()), rtol=0, atol=1e-5)
    capsys.readouterr()
    assert main(["replay", str(data), "--backend", "megatron", "--model", path, "--mode", "train",
                 "--episodes-per-step", "2", "--steps", "2", "--lr", "1e-3", "--max-tokens", "96",
                 "--save", str(tmp_path / "ckpt"), "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["steps"] == 2 and np.isfinite(last["last"]["loss"])
    # the CLI's checkpoint root holds step directories; the newest is a Hugging Face model directory
    trained = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt" / "step-000002").state_dict()
    assert not torch.equal(trained["model.norm.weight"], hf.state_dict()["model.norm.weight"])
