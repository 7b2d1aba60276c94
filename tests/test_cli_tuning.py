"""`--tuning` reaches the model: a fused-loss, recomputing replay gives the plain replay's logprobs."""

from __future__ import annotations

import numpy as np
import pyarrow.ipc as ipc

from treeflow.cli import main


def _logprobs(path) -> np.ndarray:
    col = ipc.open_file(path).read_all().column("logprobs").to_pylist()
    return np.concatenate([np.asarray(c, np.float64) for ep in col for c in ep])


def test_replay_with_tuning_matches_plain_and_bad_tuning_exits_2(tmp_path, capsys):
    eps = str(tmp_path / "eps.arrow")
    assert main(["synth", "-o", eps, "--episodes", "4", "--group-size", "2", "--max-turns", "3",
                 "--quiet"]) == 0
    plain, tuned = str(tmp_path / "plain.arrow"), str(tmp_path / "tuned.arrow")
    assert main(["replay", eps, "-o", plain, "--quiet"]) == 0
    assert main(["replay", eps, "-o", tuned, "--quiet", "--tuning",
                 "fused_loss=1,loss_vocab_chunk=1000,recompute=mlp"]) == 0
    a, b = _logprobs(plain), _logprobs(tuned)
    assert len(a) > 100 and np.abs(a - b).max() <= 1e-6 and not np.array_equal(a, np.zeros_like(a))
    capsys.readouterr()
    assert main(["replay", eps, "-o", str(tmp_path / "x.arrow"), "--tuning", "fused=1"]) == 2
    assert "'fused' is not a setting" in capsys.readouterr().err
