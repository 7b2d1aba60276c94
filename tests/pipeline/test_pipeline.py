"""Declaring pipelines: type checks before running; sources; the replay command."""

import json
import os

import numpy as np
import pyarrow as pa
import pytest
import torch

from treeflow.cli import main
from treeflow.pipeline import Files, Pipeline
from treeflow.tools import synth_episodes, write_episodes
from treeflow.stages import Forward, Fragment, Pack, Reassemble, Shard
from treeflow.ops import build_forward


def test_mismatched_stages_name_both():
    with pytest.raises(TypeError, match="Fragment produces bin/1 rows but Reassemble takes edge_values/1 rows"):
        Pipeline(Pack(), Fragment(max_tokens=64), Reassemble())
    with pytest.raises(TypeError, match="Fragment takes layout/1 rows, but a pipeline starts from episodes"):
        Pipeline(Fragment(max_tokens=64))
    with pytest.raises(TypeError, match="not a stage"):
        Pipeline(Pack(), "Fragment")


def test_bad_stage_configs_fail_when_declared(monkeypatch):
    with pytest.raises(ValueError, match="Pack\\(layout='trie'\\)"):
        Pack(layout="trie")
    with pytest.raises(ValueError, match="max_tokens"):
        Fragment(max_tokens=0)
    with pytest.raises(ValueError, match="dtype"):
        Forward(dtype="fp8")
    # the config holds no device; building on one checks it, also on a machine with CUDA:
    # the check asks torch, so make torch say there is none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda': CUDA is not available here"):
        build_forward(Forward(), device="cuda")


def test_partial_pipeline_yields_bins_per_window():
    eps = synth_episodes(episodes=8, group_size=4, turns=(2, 3), system_tokens=20, seed=0)
    out = [r.output for r in Pipeline(Pack(), Fragment(max_tokens=4096), Shard()).run(eps, episodes_per_step=4, ranks=2)]
    assert len(out) == 2
    assert [t.column("step").to_pylist()[0] for t in out] == [0, 1]


def test_files_source_streams_windows(tmp_path):
    eps = synth_episodes(episodes=10, group_size=3, turns=(2, 3), system_tokens=20, seed=0)
    write_episodes(eps, tmp_path / "a.arrow")
    wins = list(Files(paths=(str(tmp_path / "a.arrow"),), episodes_per_step=4))
    # windows end on group boundaries: groups of 3 -> 6, 4 (never a split group)
    assert [w.num_rows for w in wins] == [6, 4]
    assert pa.concat_tables(wins).column("episode_id").to_pylist() == eps.column("episode_id").to_pylist()


def test_replay_command_writes_rows_in_input_order(tmp_path, capsys):
    eps = synth_episodes(episodes=6, group_size=3, turns=(2, 3), system_tokens=30, user_tokens=(5, 9),
                         completion_tokens=(3, 9), tool_tokens=(4, 9), seed=4)
    src = tmp_path / "e.parquet"
    write_episodes(eps, src)
    outs = {}
    for layout in ("tree", "exact"):
        out = tmp_path / f"{layout}.arrow"
        assert main(["replay", str(src), "--layout", layout, "--max-tokens", "300", "--episodes-per-step", "3",
                     "-o", str(out), "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["episodes"] == 6
        table = pa.ipc.open_file(out).read_all()
        assert table.column("episode_id").to_pylist() == eps.column("episode_id").to_pylist()
        outs[layout] = summary, table
    assert outs["tree"][0]["executed_tokens"] < outs["exact"][0]["executed_tokens"]
    a = np.concatenate([np.concatenate(e) for e in outs["tree"][1].column("logprobs").to_pylist()])
    b = np.concatenate([np.concatenate(e) for e in outs["exact"][1].column("logprobs").to_pylist()])
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_replay_bad_vocab_writes_nothing(tmp_path, capsys):
    eps = synth_episodes(episodes=3, group_size=1, turns=(2, 2), system_tokens=10, seed=0)
    rows = eps.to_pylist()
    rows[2]["calls"][0]["token_ids"][3] = 35000  # beyond tiny's 32000
    src = tmp_path / "e.arrow"
    write_episodes(pa.Table.from_pylist(rows, schema=eps.schema), src)
    out = tmp_path / "out.arrow"
    # window 1: the first episode's result is already written when the second fails
    assert main(["replay", str(src), "--episodes-per-step", "1", "-o", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert ("episode 'g2-e0', call 0: field 'token_ids' holds id 35000 >= the model's vocabulary "
            "size 32000") in err
    # one line, and nothing left: neither the output nor a temporary of it
    assert err.startswith("error:") and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["e.arrow"]


def test_replay_model_dir_without_weights(tmp_path, capsys):
    eps = synth_episodes(episodes=2, group_size=1, turns=(2, 2), system_tokens=10, seed=0)
    write_episodes(eps, tmp_path / "e.arrow")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2}))
    assert main(["replay", str(tmp_path / "e.arrow"), "--model", str(model),
                 "-o", str(tmp_path / "o.arrow")]) == 2
    assert "no model.safetensors or model.safetensors.index.json" in capsys.readouterr().err
    assert not (tmp_path / "o.arrow").exists()


def test_forward_config_holds_no_model_and_refuses_to_run_bins():
    # the config is pure: calling it would have to load a model per call; build its operator
    with pytest.raises(TypeError, match="Forward is a configuration and holds no model"):
        Forward()(pa.table({}))


def test_forward_names_the_bin_of_an_out_of_vocabulary_target():
    from treeflow.schemas import validate_episodes

    eps = validate_episodes(pa.Table.from_pylist(
        [{"episode_id": "o", "calls": [{"token_ids": [1, 2, 40000], "sampled_start": 1}]}]))
    with pytest.raises(ValueError, match="bin 0 of step 0 holds token id 40000 >= the model's vocabulary size 32000"):
        build_forward(Forward())(Fragment(max_tokens=64)(Pack()(eps)))
