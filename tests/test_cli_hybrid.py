"""`treeflow replay` and `--mode train` on a Mamba-2 hybrid checkpoint, with the SSM flags."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from tests.deps import require
from tests.models.hybrid_helpers import save_hf
from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes

require("transformers")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_hybrid")
    hf = save_hf("nemotron_h", tmp / "nh")
    eps = synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=10,
                         user_tokens=(2, 5), completion_tokens=(2, 6), tool_tokens=(2, 5),
                         vocab_size=61, seed=2)
    write_episodes(eps, tmp / "e.arrow")
    return tmp, hf, eps


@pytest.mark.parametrize("flags", [["--ssm-fork", "exact"], ["--ssm-fork", "chunk"]])
def test_replay_matches_transformers(setup, flags, capsys):
    tmp, hf, eps = setup
    out = tmp / f"o{flags[1]}.arrow"
    assert main(["replay", str(tmp / "e.arrow"), "--model", str(tmp / "nh"), "--max-tokens", "48",
                 "--quiet", "-o", str(out), *flags]) == 0
    got = pa.ipc.open_file(out).read_all().to_pylist()
    worst = 0.0
    with torch.no_grad():
        for ep, row in zip(eps.to_pylist(), got):
            for call, lp in zip(ep["calls"], row["logprobs"]):
                ids = torch.tensor([call["token_ids"]])
                s = call["sampled_start"]
                want = torch.log_softmax(hf(ids).logits[0].float(), -1)[s - 1:-1]
                want = want.gather(-1, ids[0, s:, None])[:, 0]
                worst = max(worst, float((torch.tensor(lp) - want).abs().max()))
    assert worst < 1e-5


def test_train_with_bfloat16_states(setup, capsys):
    tmp, _, _ = setup
    assert main(["replay", str(tmp / "e.arrow"), "--model", str(tmp / "nh"), "--mode", "train",
                 "--episodes-per-step", "2", "--steps", "2", "--loss", "nll", "--max-tokens", "64",
                 "--ssm-state-dtype", "bfloat16", "--ssm-kernel", "torch", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ssm_kernel"] == "torch"
    with pytest.raises(SystemExit):
        main(["replay", str(tmp / "e.arrow"), "--ssm-fork", "sideways"])
