"""The family declarations (treeflow/models/families.py): README's table is generated from them,
they cover exactly the classes the configs read, and the checks that refuse a combination
read them (a family declared without a feature is refused by name)."""

from __future__ import annotations

import json
import os

import pytest

from treeflow.parallel import ParallelDims

from treeflow.models import families
from treeflow.models.config.model import ARCHITECTURES, ModelConfig
from treeflow.models.config.deepseek import DEEPSEEK_ARCHITECTURES
from treeflow.models.config.gdn import GDN_ARCHITECTURES
from treeflow.models.config.gemma3 import GEMMA3_ARCHITECTURES
from treeflow.models.config.gpt_oss import GPT_OSS_ARCHITECTURES
from treeflow.models.config.hybrid import HYBRID_ARCHITECTURES

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_table_is_generated_from_the_declarations():
    with open(README) as f:
        text = f.read()
    assert families.readme_with_table(text) == text, (
        "README.md's model family table is stale: run python -c \"from treeflow.models."
        "families import write_readme; write_readme('README.md')\"")
    for f in families.FAMILIES:  # every family has its row, every flag its cell
        row = next(line for line in text.splitlines() if line.startswith(f"| {f.name} |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        only = "recompute only" if f.no_compiled_layers else "yes"  # recompute, not compiled
        assert cells[3:7] == [(only if k == "recompute" else "yes") if getattr(f, k) else "no"
                              for k in families.FEATURES]


def test_declarations_cover_exactly_what_the_configs_read():
    declared = [a for f in families.FAMILIES for a in f.architectures]
    assert len(declared) == len(set(declared))
    assert set(declared) == set(ARCHITECTURES) | set(HYBRID_ARCHITECTURES) | set(
        GEMMA3_ARCHITECTURES) | set(GPT_OSS_ARCHITECTURES) | set(DEEPSEEK_ARCHITECTURES) | set(
            GDN_ARCHITECTURES)
    assert not set(families.NOT_YET) & set(declared)


def test_an_unsupported_family_is_one_line_naming_it_and_what_is_supported():
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict({"architectures": ["Qwen3_5ForConditionalGeneration"]})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("model family Qwen3_5ForConditionalGeneration (Qwen3.5 vision-language")
    assert all(f"{f.name} ({f.architectures[0]})" in msg for f in families.FAMILIES)
    with pytest.raises(ValueError, match=r"model family 'FalconForCausalLM' is not supported; "
                                         r"treeflow reads Llama \(LlamaForCausalLM\)"):
        ModelConfig.from_hf_dict({"architectures": ["FalconForCausalLM"]})


def _hybrid(tmp_path):
    from tests.models.hybrid_helpers import save_hf

    save_hf("bamba", tmp_path)
    return str(tmp_path)


def test_a_feature_the_family_lacks_is_refused_by_name(tmp_path, monkeypatch):
    """Per-part recompute on a Mamba-2 hybrid, and context parallelism on a family declared
    without it (Bamba's declaration, flipped: hybrids have it); flipping the declaration back
    is what lets the run through to the next check."""
    from treeflow.models import Tuning, load_backend
    from treeflow.ops import build_forward
    from treeflow.stages import Forward

    path = _hybrid(tmp_path)
    # a hybrid recomputes whole blocks only (models/compile/recompute.py); the finer modes are refused
    with pytest.raises(ValueError, match=r"BambaForCausalLM: Tuning\(compile_layers=False, "
                                         r"recompute='mlp'\).*use --recompute selective, full"):
        load_backend("reference", path, tuning=Tuning(recompute="mlp"))
    backend = load_backend("reference", path)
    bamba = next(f for f in families.FAMILIES if f.name == "Bamba")

    def declare(context_parallel: bool) -> None:
        flipped = tuple(f if f is not bamba else families.Family(
            **{**bamba.__dict__, "context_parallel": context_parallel}) for f in families.FAMILIES)
        monkeypatch.setattr(families, "_BY_ARCH", {a: f for f in flipped for a in f.architectures})

    declare(False)
    with pytest.raises(ValueError, match=r"Bamba \(BambaForCausalLM\): context parallelism"):
        build_forward(Forward(), model=backend, dims=ParallelDims(cp=2))
    declare(True)
    with pytest.raises(ValueError, match="process group"):  # past the declaration
        build_forward(Forward(), model=backend, dims=ParallelDims(cp=2))


def test_cli_refuses_a_not_yet_family_in_one_line(tmp_path, capsys):
    from treeflow.cli import main
    from treeflow.tools import synth_episodes, write_episodes

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}))
    write_episodes(synth_episodes(episodes=2, vocab_size=61, seed=0), tmp_path / "e.arrow")
    assert main(["replay", str(tmp_path / "e.arrow"), "--model", str(tmp_path / "m"),
                 "-o", str(tmp_path / "o.arrow")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "vision-language" in err[0], err


def _tiny_checkpoint(architecture: str, path):
    """A tiny random checkpoint of `architecture`, saved by transformers' own class (the
    family tests' models); the transformers model."""
    from hybrid_helpers import hf_model as hf_hybrid
    from hybrid_moe_helpers import hf_model as hf_hybrid_moe
    from qwen3_next_helpers import hf_qwen3_next

    from tests.models.families_helpers import (VOCAB, drawn, hf_deepseek, hf_gemma3,
                                               hf_gpt_oss, hf_qwen3, transformers)
    from tests.models.moe_helpers import hf_model as hf_moe

    def dense(config_class):
        return lambda: drawn(transformers.AutoModelForCausalLM.from_config(config_class(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)))

    makers = {"LlamaForCausalLM": dense(transformers.LlamaConfig),
              "Qwen2ForCausalLM": dense(transformers.Qwen2Config), "Qwen3ForCausalLM": hf_qwen3,
              "Qwen3MoeForCausalLM": lambda: hf_moe("qwen3_moe"),
              "Qwen2MoeForCausalLM": lambda: hf_moe("qwen2_moe"),
              "MixtralForCausalLM": lambda: hf_moe("mixtral"),
              "Gemma3ForCausalLM": hf_gemma3, "GptOssForCausalLM": hf_gpt_oss,
              "Glm4MoeForCausalLM": lambda: hf_deepseek("glm4_moe"),
              "DeepseekV3ForCausalLM": lambda: hf_deepseek("deepseek_v3"),
              "NemotronHForCausalLM": lambda: hf_hybrid("nemotron_h"),
              "BambaForCausalLM": lambda: hf_hybrid("bamba"),
              "GraniteMoeHybridForCausalLM": lambda: hf_hybrid_moe("granitemoehybrid"),
              "Qwen3NextForCausalLM": lambda: hf_qwen3_next(family="qwen3_next"),
              "Qwen3_5ForCausalLM": lambda: hf_qwen3_next(family="qwen3_5"),
              "Qwen3_5MoeForCausalLM": lambda: hf_qwen3_next(family="qwen3_5_moe")}
    model = makers[architecture]()  # a KeyError: a new family needs its maker here
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", [f for f in families.FAMILIES if not f.megatron],
                         ids=lambda f: f.name)
def test_megatron_is_refused_by_family_name_where_mcore_lacks_the_family(family, tmp_path):
    """Every family declared without megatron: the CLI's check (before any load) and the
    megatron backend itself refuse it in one line naming the family and those that have it."""
    from treeflow.models import load_backend
    from treeflow.stages import Forward

    arch = family.architectures[0]
    _tiny_checkpoint(arch, tmp_path)
    line = (rf"{family.name} \({arch}\): the megatron backend \(--backend megatron\) is not "
            rf"supported yet; families that have it: Llama, Qwen2, Qwen3, Qwen3-MoE")
    with pytest.raises(ValueError, match=rf"{tmp_path}: {line}.*: use --backend reference") as e:
        Forward(model=str(tmp_path), backend="megatron").check_model()
    assert "\n" not in str(e.value)
    pytest.importorskip("megatron.core")
    with pytest.raises(ValueError, match=line):
        load_backend("megatron", str(tmp_path))


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.name)
def test_replay_runs_every_family_as_readme_says(family, tmp_path):
    """`treeflow replay EPISODES --model DIR` on each declared family's tiny checkpoint:
    the sampled tokens' logprobs = transformers' own class call by call (1e-5)."""
    from family_checks import check_cli_replay

    for arch in family.architectures:
        hf = _tiny_checkpoint(arch, tmp_path / arch)
        check_cli_replay(hf, tmp_path / arch, tmp_path)


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.name)
def test_auto_tuning_on_a_hopper_gpu_picks_what_the_family_runs(family, tmp_path, monkeypatch):
    """`--tuning auto` (the CLI's default) on an H100 picks "fast" (compiled layers); a family
    declared without those levers must get a preset its backend accepts (it had refused every
    default GPU run of Gemma 3 and gpt-oss). The device is made to answer as a Hopper GPU."""
    import torch

    from treeflow.models import Tuning, load_backend
    from treeflow.models.config.hybrid import is_hybrid_dir
    from treeflow.models.tuning import resolve_auto

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    arch = family.architectures[0]
    _tiny_checkpoint(arch, tmp_path)
    chosen, why = resolve_auto("auto", device="cuda", model=tmp_path)
    levers = family.recompute and not family.no_compiled_layers
    assert levers or is_hybrid_dir(tmp_path) or family.name == "Gemma 3"
    assert chosen == ("fast" if levers else "plain"), (chosen, why)
    load_backend("reference", str(tmp_path), tuning=Tuning.parse(chosen))  # accepted
