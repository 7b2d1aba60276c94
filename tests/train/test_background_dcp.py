"""Background saves of sharded (DCP) checkpoints: the files a synchronous save writes, while the
next step computes on every rank (2 gloo ranks, FSDP2 `shard_params`, CPU, float32)."""

import hashlib
import json
import os
import time

import pytest

from tests.train.test_data_parallel import TIMEOUT_S, data, reduce_for
from tests.train.test_training import small_model
from treeflow.stages import Forward, Fragment, Pack, Shard
from treeflow.train import DataParallel, Trainer
from treeflow.train.launch import spawn

# one xdist worker runs the module: its tests share one spawn (a module fixture), which a
# second worker would start again
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("test_background_dcp")]


def _slow_dcp_writes():
    """Each DCP item written 30 ms late: the write outlasts the next step's forward/backward."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item

    def slow(*args, **kwargs):
        time.sleep(0.03)
        return real(*args, **kwargs)

    fs._write_item = slow


def _step(tr, dp, eps, budget):
    bins = Shard()(Fragment(max_tokens=budget)(Pack()(eps)), ranks=dp.world)
    tr.train_step(eps, bins)


def _rank(root):
    """Both tests' rank side in one process group (a spawn of two ranks costs their start --
    torch, the group -- as much as either run): the good saves first, then the failing one."""
    dp = DataParallel.from_env("cpu")
    out = {"sync_then_background": _sync_then_background(root, dp),
           "failing": _failing_background_write(root, dp)}
    dp.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("bgdcp")
    return root, spawn(_rank, 2, str(root), timeout_s=2 * TIMEOUT_S, threads=1)


def _sync_then_background(root, dp):
    """In every rank: one step, a synchronous save, a background save, the next step at once."""
    _slow_dcp_writes()
    eps, budget = data()
    tr = Trainer(Forward(), reduce_for("pg", "seq-mean"), model=small_model(), dp=dp,
                 shard_params=True)
    _step(tr, dp, eps.slice(0, 4), budget)
    tr.save(os.path.join(root, "sync"))
    path = tr.save(os.path.join(root, "bg"), background=True)
    running = tr._saving is not None and tr._saving.running
    _step(tr, dp, eps.slice(4), budget)  # its AdamW step must wait for this rank's writer
    waited = tr.last_timing["save_wait_s"]
    left = tr.wait_for_save()
    return {"path": path, "running": running, "waited": waited, "left": left}


def _files(step_dir):
    out = {}
    for d, _, names in os.walk(step_dir):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, step_dir)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _metadata(step_dir):
    """DCP's index without its per-save stamp (a fresh uuid and the temporary path)."""
    from treeflow.train import dcp_safe

    meta = dcp_safe.read_metadata(os.path.join(step_dir, "dcp"))
    return meta.state_dict_metadata, meta.storage_data


def test_background_sharded_save_writes_what_a_synchronous_save_writes(ranks):
    tmp_path, runs = ranks[0], [r["sync_then_background"] for r in ranks[1]]
    assert all(r["running"] for r in runs)  # save returned on every rank before its write ended
    assert all(r["waited"] > 0 for r in runs)  # and the next AdamW step waited for it
    assert all(r["left"] == 0.0 for r in runs)
    sync, bg = tmp_path / "sync" / "step-000001", tmp_path / "bg" / "step-000001"
    assert runs[0]["path"] == str(bg)
    a, b = _files(sync), _files(bg)
    assert sorted(a) == sorted(b) and any(n.startswith("dcp/__") for n in a)
    stamped = {"dcp/.metadata", "manifest.json"}  # DCP stamps each save with a uuid and its path
    assert {n: h for n, h in a.items() if n not in stamped} == \
        {n: h for n, h in b.items() if n not in stamped}
    assert _metadata(sync) == _metadata(bg)
    manifests = [json.loads((d / "manifest.json").read_text())["files"] for d in (sync, bg)]
    for m in manifests:
        m.pop("dcp/.metadata")
    assert manifests[0] == manifests[1]
    assert (tmp_path / "bg" / "latest.txt").read_text().strip() == "step-000001"


def _failing_background_write(root, dp):
    """In every rank: a background save whose DCP writes fail (a full disk), then the next step."""
    import torch.distributed.checkpoint.filesystem as fs

    eps, budget = data()
    tr = Trainer(Forward(), reduce_for("pg", "seq-mean"), model=small_model(), dp=dp,
                 shard_params=True)
    _step(tr, dp, eps.slice(0, 4), budget)
    tr.save(os.path.join(root, "ck"))  # step 1, complete

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    fs._write_item = full
    _step(tr, dp, eps.slice(4, 6), budget)
    tr.save(os.path.join(root, "ck"), background=True)  # step 2: its write fails
    try:
        _step(tr, dp, eps.slice(6), budget)
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"error": error}


def test_a_failed_background_sharded_write_is_every_rank_s_error(ranks):
    tmp_path, runs = ranks[0], [r["failing"] for r in ranks[1]]
    for r in runs:
        assert r["error"] and "background checkpoint save failed" in r["error"], r
    ck = tmp_path / "ck"
    assert (ck / "latest.txt").read_text().strip() == "step-000001"  # nothing half-written won
    assert sorted(n for n in os.listdir(ck) if n.startswith("step-")) == ["step-000001"]
    assert not [n for n in os.listdir(ck) if n.startswith(".") or "partial" in n or "tmp" in n]
