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


def test_auto_picks_fast_on_hopper_only_and_says_so(capsys, monkeypatch):
    """`--tuning auto` (the default): fast on a capability-9 GPU with the reference backend,
    plain elsewhere and where fast is refused or unmeasured; the choice on stderr and kept for
    the JSON. The GPU is faked at torch.cuda's capability query (the rule runs before any model
    code touches the device)."""
    import argparse

    import torch

    from treeflow.cli.configs import tuning_text
    from treeflow.models.tuning import PRESETS, Tuning, auto_preset

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])

    def chosen(**flags):
        args = argparse.Namespace(**{"tuning": "auto", "device": "cuda", "backend": None,
                                     "shard_params": False, "tensor_parallel": 1,
                                     "context_parallel": 1, **flags})
        return tuning_text(args, "tiny"), args.tuning_chosen

    assert chosen() == ("fast", "fast")
    assert "--tuning auto: fast (Hopper GPU (capability 9.0))" in capsys.readouterr().err
    assert Tuning.parse(chosen(tuning="auto,recompute=mlp")[0]) == PRESETS["lean"]
    for flags in ({"shard_params": True}, {"backend": "megatron"}, {"tensor_parallel": 2},
                  {"device": "cpu"}, {"tuning": "plain"}):
        assert chosen(**flags)[0] == "plain", flags
    cap[0] = (8, 0)
    assert chosen()[0] == "plain"
    assert "measured on Hopper (capability 9.x), not 8.0" in capsys.readouterr().err
    assert auto_preset(device_type="cuda", capability=(9, 0), hybrid=True)[0] == "plain"
    assert auto_preset(device_type="cuda", capability=(10, 0))[0] == "plain"


def test_json_says_which_preset_ran(tmp_path, capsys):
    eps = str(tmp_path / "eps.arrow")
    assert main(["synth", "-o", eps, "--episodes", "2", "--min-turns", "1", "--max-turns", "2",
                 "--quiet"]) == 0
    capsys.readouterr()
    assert main(["replay", eps, "-o", str(tmp_path / "lp.arrow"), "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tuning"] == "plain"  # auto on CPU: the plain path, nothing said
