"""`treeflow replay --context-parallel 2` on a tiny Qwen3.5 (Gated DeltaNet hybrid) checkpoint:
the CLI's logprobs and two training steps equal one process given bins of the same budget
(C x --max-tokens).

The episodes (tests/models/hybrid_helpers.py) are two GRPO groups whose prompts end inside a
GDN chunk (65 tokens) and on its boundary (64), each with a multi-level agent episode; the
longest call (74 tokens) fits 2 x BUDGET but not BUDGET, so a CP rank holds part of a path.
Tolerances as tests/models/ssm/test_hybrid_context_parallel_cli.py's: logprobs 1e-6 of the
largest; the first step's loss and gradient norm 1e-6 relative (float64 gradient sums), the
second step's loss 1e-5.

The second step's gradient norm is not compared between the two runs: it differed by 1.1e-4
relative (3.54111 vs 3.54150) although the CP step is exact. The step-1 gradients (clipped to
norm 1) of both runs differ by float32 summation order only (no sign differs), but AdamW's first
update lr g / (|g| + eps) amplifies an absolute gradient error d by up to lr d / eps where
|g| ~ eps = 1e-8: embed_tokens[36, 28] (g 5.25e-8 one process, 4.40e-8 CP, 4.67e-8 in float64)
moved 2.5e-5 apart, and that one entry, copied into the one-process checkpoint, gives CP's step-2
norm. So step 2 is checked where it is well posed: (a) after step 1 the two runs' weights agree
to float32 rounding wherever AdamW's update is lr |g| / (|g| + eps) >= 0.99 lr (|g| >= 99 eps),
and (b) one process resumed from the CP run's step-1 checkpoint gives the CP run's step 2, loss
and gradient norm within 1e-6 (measured: bitwise norm, loss 5e-8), so weights that drift
between CP ranks, or a step-2 forward or backward that differs, fail at step 1's bound.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from hybrid_helpers import episodes
from qwen3_next_helpers import VOCAB, hf_qwen3_next
from safetensors.torch import load_file

from tests.deps import require
from treeflow.cli import main
from treeflow.schemas import EPISODE_SCHEMA, validate_episodes
from treeflow.tools import write_episodes

require("transformers")

pytestmark = pytest.mark.multiprocess

BUDGET = 40  # per rank
LR = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gdn-cp-cli")
    hf_qwen3_next(family="qwen3_5").save_pretrained(root / "model")
    rows = [r for p in (65, 64) for r in episodes(p, seed=p, vocab=VOCAB).to_pylist()]
    for i, r in enumerate(rows):
        r["episode_id"], r["sample_index"] = f"{r['episode_id']}-{i}", i
        r["group_id"] = None if r["group_id"] is None else f"{r['group_id']}-{i // 4}"
    assert max(len(c["token_ids"]) for r in rows for c in r["calls"]) > BUDGET
    data = root / "e.arrow"
    write_episodes(validate_episodes(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA)), data)
    return str(root / "model"), str(data)


def _logprobs(path) -> np.ndarray:
    with ipc.open_file(path) as f:
        col = f.read_all().column("logprobs").to_pylist()
    return np.array([v for ep in col for call in ep for v in call], np.float64)


def _train(model, data, out, *extra) -> list:
    args = ["replay", data, "--model", model, "--mode", "train", "--episodes-per-step", "4",
            "--lr", str(LR), "--loss", "nll", "--norm", "seq-mean", "--grad-sum", "float64",
            "--steps", "2", "--json", "--metrics", f"{out}.jsonl", *extra]
    assert main(args) == 0
    return [json.loads(line) for line in open(f"{out}.jsonl")]


def test_qwen3_5_replay_and_train_at_context_parallel_2_equal_one_process(setup, tmp_path,
                                                                          capsys):
    model, data = setup
    base = ["replay", data, "--model", model, "--json"]
    assert main([*base, "--max-tokens", str(2 * BUDGET), "-o", str(tmp_path / "one.arrow")]) == 0
    assert main([*base, "--max-tokens", str(BUDGET), "--context-parallel", "2",
                 "-o", str(tmp_path / "cp.arrow")]) == 0
    one, cp = _logprobs(tmp_path / "one.arrow"), _logprobs(tmp_path / "cp.arrow")
    assert one.shape == cp.shape and np.abs(one).mean() > 1.0
    assert np.abs(cp - one).max() <= 1e-6 * np.abs(one).max()
    a = _train(model, data, tmp_path / "t1", "--max-tokens", str(2 * BUDGET),
               "--save", str(tmp_path / "s1"), "--save-every", "1")
    b = _train(model, data, tmp_path / "t2", "--max-tokens", str(BUDGET),
               "--context-parallel", "2", "--save", str(tmp_path / "s2"), "--save-every", "1")
    capsys.readouterr()
    x, y = a[0], b[0]  # the first step: same weights, same bins' gradients
    for key in ("loss", "grad_norm"):
        assert abs(x[key] - y[key]) <= 1e-6 * abs(x[key]), (key, x[key], y[key])
    for x, y in zip(a, b, strict=True):
        assert (x["sampled_tokens"], x["loss_tokens"]) == (y["sampled_tokens"], y["loss_tokens"])
        assert y["context_parallel"] == 2
    assert abs(a[1]["loss"] - b[1]["loss"]) <= 1e-5 * abs(a[1]["loss"])
    # (a) the weights after step 1, entry by entry, where AdamW's update is well conditioned
    w0 = load_file(f"{model}/model.safetensors")
    one, cp = (load_file(tmp_path / d / "step-000001" / "model.safetensors") for d in ("s1", "s2"))
    assert one.keys() == cp.keys() == w0.keys()
    kept = 0
    for name, w in one.items():
        well = (w.double() - w0[name].double()).abs() >= 0.99 * LR
        kept += int(well.sum())
        diff = (cp[name].double() - w.double()).abs()
        bound = 2.0 ** -21 * w.double().abs() + 1e-5 * LR  # float32 rounding of w - lr u
        assert bool((diff <= bound)[well].all()), (name, float(diff[well].max()))
    assert kept >= 0.9 * sum(w.numel() for w in w0.values())  # 349 of 44720 left out
    # (b) step 2 from the same weights and AdamW state: one process resumed from CP's step 1
    shutil.copytree(tmp_path / "s2" / "step-000001", tmp_path / "s3" / "step-000001")
    c = _train(model, data, tmp_path / "t3", "--max-tokens", str(2 * BUDGET),
               "--resume", str(tmp_path / "s3"))
    capsys.readouterr()
    assert [r["step"] for r in c] == [2]
    for key in ("loss", "grad_norm"):
        assert abs(c[0][key] - b[1][key]) <= 1e-6 * abs(b[1][key]), (key, c[0][key], b[1][key])
