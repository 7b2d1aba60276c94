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
    assert _worst_gap(hf, eps, out) < 1e-5


def _worst_gap(hf, eps, out) -> float:
    """The largest |logprob - transformers' float32 logprob| of the replay written to `out`,
    transformers running each call on its own."""
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
    return worst


def test_train_with_bfloat16_states(setup, capsys):
    tmp, _, _ = setup
    assert main(["replay", str(tmp / "e.arrow"), "--model", str(tmp / "nh"), "--mode", "train",
                 "--episodes-per-step", "2", "--steps", "2", "--loss", "nll", "--max-tokens", "64",
                 "--ssm-state-dtype", "bfloat16", "--ssm-kernel", "torch", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ssm_kernel"] == "torch"
    with pytest.raises(SystemExit):
        main(["replay", str(tmp / "e.arrow"), "--ssm-fork", "sideways"])


def test_scan_precision_reaches_the_kernels(setup, capsys):
    """`--tuning ssm_precision=...` (`--ssm-precision`) sets the Triton scan's products (under Triton's interpreter
    here): ieee equals transformers' float32 per call, bf16 operands move the logprobs by
    bf16 rounding (so the setting reached the kernels), and the run JSON says which ran."""
    tmp, hf, eps = setup
    worst = {}
    for precision in ("ieee", "bf16"):
        out = tmp / f"p{precision}.arrow"
        assert main(["replay", str(tmp / "e.arrow"), "--model", str(tmp / "nh"),
                     "--max-tokens", "48", "--ssm-kernel", "triton", "--tuning",
                     f"ssm_precision={precision}", "--json", "-o", str(out)]) == 0
        run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (run["ssm_kernel"], run["ssm_precision"]) == ("triton", precision)
        worst[precision] = _worst_gap(hf, eps, out)
    assert worst["ieee"] < 1e-5
    # bf16 operands: each rounded by at most 2^-9 relative, so a product moves by about 2^-8 of
    # itself, and the scan's output and the logprobs it feeds by no more at this depth (two
    # Mamba layers; measured 3.3e-4 here, deterministic on CPU); above ieee's 1e-6 by far
    assert 1e-5 < worst["bf16"] < 2.0 ** -8, worst


def test_scan_precision_is_refused_where_no_triton_scan_runs(setup):
    """A precision for a run whose scan is the torch one (asked for, or under context
    parallelism, whose head split runs torch) is refused before any work, by name."""
    import argparse

    from treeflow.cli.configs import ssm_kernel
    from treeflow.models.tuning import Tuning

    tmp, _, _ = setup
    with pytest.raises(ValueError, match="the torch scan computes in float32"):
        Tuning.parse("ssm_precision=bf16", ssm_kernel="torch")
    args = argparse.Namespace(model=str(tmp / "nh"), device="cpu", dtype="float32",
                              context_parallel=1)
    with pytest.raises(ValueError, match="this run's scan is torch"):
        ssm_kernel(args, Tuning.parse("ssm_precision=bf16"))  # auto on CPU: torch
    assert ssm_kernel(args, Tuning.parse("")) == {"ssm_kernel": "torch"}
    # on CUDA (not run here: the choice is read, nothing launched) auto is mamba_ssm's bf16
    # products for a bf16 model, float32 ones for a float32 model
    gpu = argparse.Namespace(**{**vars(args), "device": "cuda", "dtype": "bfloat16"})
    assert ssm_kernel(gpu, Tuning.parse("")) == {"ssm_kernel": "triton", "ssm_precision": "bf16"}
    gpu.dtype = "float32"
    assert ssm_kernel(gpu, Tuning.parse("")) == {"ssm_kernel": "triton", "ssm_precision": "ieee"}
    # auto under context parallelism: the torch scan that runs, not the fused one auto would
    # pick on CUDA without it (a Triton kernel or precision asked for there is refused by
    # models/support.py's table: tests/models/test_support.py)
    cuda = argparse.Namespace(**{**vars(args), "device": "cuda", "context_parallel": 2})
    assert ssm_kernel(cuda, Tuning.parse("")) == {"ssm_kernel": "torch"}
    # the Python API's last line: the backend refuses before a bin is planned
    from treeflow.models import load_backend

    with pytest.raises(ValueError, match="on cpu the scan is torch's"):
        load_backend("reference", str(tmp / "nh"), tuning=Tuning(ssm_precision="bf16"))
