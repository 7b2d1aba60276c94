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
        assert cells[3:7] == ["yes" if getattr(f, k) else "no" for k in families.FEATURES]


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
