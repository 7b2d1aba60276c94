"""--offload (FSDP2's CPUOffloadPolicy behind --shard-params), gloo on CPU.

On CPU the policy's copies are host-to-host, so what is checked is the mechanics: every
FSDP2 group runs with the offload policy, the sharded parameters, gradients and AdamW's
moments are host tensors, a step equals the same step without offload bit for bit (the same
float32 operations), a checkpoint written with it resumes, and `plan --memory --offload`
drops the state from the device's bytes. The device-memory saving itself needs a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from treeflow.cli import main
from treeflow.train.launch import spawn

pytestmark = pytest.mark.multiprocess


def _rank(data):
    """The step without offload, then with it, in one process group (a second spawn of two
    ranks cost their start again: torch, the group)."""
    from treeflow.train import DataParallel

    dp = DataParallel.from_env("cpu")
    out = {"plain": _step(data, dp, False), "offload": _step(data, dp, True)}
    dp.close()
    return out


def _step(data, dp, offload):
    import pyarrow.ipc as ipc
    from torch.distributed.fsdp import CPUOffloadPolicy

    from treeflow.pipeline import Pipeline
    from treeflow.stages import Forward, Fragment, Loss, Pack, Reduce, Shard
    from treeflow.stages.reduce import EpisodeSchedule
    from treeflow.train import Trainer
    from treeflow.train.fsdp import full_state_dict

    fwd = Forward(model="tiny")
    red = Reduce(loss=Loss(kind="nll"), schedule=EpisodeSchedule(lr=1e-3))
    tr = Trainer(fwd, red, dp=dp, shard_params=True, offload=offload)
    policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                for m in tr.model.modules() if hasattr(m, "_get_fsdp_state")
                and m._get_fsdp_state()._fsdp_param_group is not None}
    with ipc.open_file(data) as f:
        eps = f.read_all()
    pipe = Pipeline(Pack(), Fragment(max_tokens=2048), Shard(), fwd, red)
    rows = [r.output.to_pylist()[0] for r in pipe.run(eps, episodes_per_step=len(eps),
                                                      trainer=tr)]
    moments = {v.device.type for st in tr.optimizer.state.values() for k, v in st.items()
               if k in ("exp_avg", "exp_avg_sq")}
    params = {p.device.type for p in tr.model.parameters()}
    state = full_state_dict(tr.model)
    return {"policies": sorted(policies), "offload_policy": CPUOffloadPolicy.__name__,
            "moments": sorted(moments), "params": sorted(params), "loss": rows[0]["loss"],
            "state": state}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("offload") / "e.arrow"
    assert main(["synth", "-o", str(path), "--episodes", "4", "--group-size", "2",
                 "--min-turns", "1", "--max-turns", "2", "--quiet"]) == 0
    return path


def test_offloaded_step_equals_the_step_without_it(data):
    runs = spawn(_rank, 2, str(data), timeout_s=480, threads=1)
    plain, off = [r["plain"] for r in runs], [r["offload"] for r in runs]
    assert plain[0]["policies"] == ["OffloadPolicy"]
    assert off[0]["policies"] == [off[0]["offload_policy"]]  # every group: CPUOffloadPolicy
    assert off[0]["moments"] == off[0]["params"] == ["cpu"]
    assert off[0]["loss"] == plain[0]["loss"]
    for name, want in plain[0]["state"].items():
        assert torch.equal(off[0]["state"][name], want), name


def test_offload_resumes_and_is_refused_without_sharding(data, tmp_path, capfd):
    args = ["replay", str(data), "--model", "tiny", "--mode", "train", "--episodes-per-step",
            "2", "--lr", "1e-3", "--loss", "nll", "--json", "--num-ranks", "2",
            "--shard-params", "--offload", "--save", str(tmp_path / "ck")]
    assert main([*args, "--steps", "1"]) == 0
    capfd.readouterr()
    assert main([*args[:-2], "--steps", "2", "--resume", str(tmp_path / "ck")]) == 0
    assert json.loads(capfd.readouterr().out.strip().splitlines()[-1])["steps"] == 2
    assert main(["replay", str(data), "--model", "tiny", "--mode", "train",
                 "--episodes-per-step", "2", "--offload"]) == 2
    err = capfd.readouterr().err
    assert "--offload" in err and "add --shard-params" in err, err


def test_plan_memory_offload_moves_the_state_off_the_device(capsys):
    knobs = ["plan", "--memory", "--model", "tiny", "--max-tokens", "512", "--num-ranks", "2",
             "--shard-params", "--json"]
    assert main(knobs) == 0
    on = json.loads(capsys.readouterr().out)
    assert main([*knobs, "--offload"]) == 0
    off = json.loads(capsys.readouterr().out)
    for k in ("weights", "gradients", "optimizer"):
        assert on["bytes"][k] > 0 and off["bytes"][k] == 0, k
    assert off["bytes"]["weight_casts"] == on["bytes"]["weight_casts"]  # gathered on device
    assert off["bytes"]["activations"] == on["bytes"]["activations"]
    assert off["host_bytes"] == on["bytes"]["weights"] + on["bytes"]["gradients"] + \
        on["bytes"]["optimizer"]
