"""Issue 20: a checkpoint runs no code, whatever was planted in it (each failed before the fix).

Every payload here is a pickle whose loading creates a marker file; each test asserts the
marker is absent and that the load was refused with a message naming the file at fault.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import warnings

import pytest
import torch

from tests.reliability.helpers import TRAIN, cli, write_small
from treeflow.cli import main


class _Payload:
    """Unpickling it opens (creates) `marker`: proof that code from the file ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _evil_pickle(path, marker) -> None:
    with open(path, "wb") as f:
        pickle.dump(_Payload(str(marker)), f)


def refused(rc, err, *needles):
    """Exit 2, and the error (the last line; a fallback notice may precede it) names them."""
    assert rc == 2, err
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("error:") and "Traceback" not in err, err
    for n in needles:
        assert n in last, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data file, checkpoint root) of a one-step run, shared read-only by the tests."""
    d = tmp_path_factory.mktemp("ck")
    data = write_small(d / "e.arrow")
    assert main(["replay", data, *TRAIN, "--steps", "1", "--save", str(d / "ck")]) == 0
    return data, d / "ck"


def _copy(trained, tmp_path):
    data, ck = trained
    shutil.copytree(ck, tmp_path / "ck")
    return data, tmp_path / "ck", tmp_path / "ck" / "step-000001"


def _resign(step) -> None:
    """Rewrite the manifest over every file now in `step` (what an attacker can always do)."""
    files = {}
    for d, _, names in os.walk(step):
        for n in names:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, step)
            if rel != "manifest.json":
                files[rel] = {"bytes": os.path.getsize(p),
                              "sha256": hashlib.sha256(open(p, "rb").read()).hexdigest()}
    (step / "manifest.json").write_text(json.dumps({"format": "treeflow-checkpoint/2",
                                                    "files": files}))


def test_a_dcp_index_planted_in_a_verified_checkpoint_is_refused(trained, tmp_path, capsys):
    data, ck, step = _copy(trained, tmp_path)
    (step / "dcp").mkdir()
    _evil_pickle(step / "dcp" / ".metadata", tmp_path / "pwned")
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", ck)
    assert not (tmp_path / "pwned").exists(), "resuming ran the planted pickle"
    refused(rc, err, "dcp/.metadata", "not in its manifest.json")


def test_a_resigned_checkpoint_with_a_malicious_dcp_index_runs_no_code(trained, tmp_path, capsys):
    # the manifest proves a save finished, not who wrote it: the reader itself must be safe
    data, ck, step = _copy(trained, tmp_path)
    (step / "dcp").mkdir()
    _evil_pickle(step / "dcp" / ".metadata", tmp_path / "pwned")
    _resign(step)
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", ck)
    assert not (tmp_path / "pwned").exists(), "resuming ran the pickled DCP index"
    refused(rc, err, ".metadata", "refused", "not DCP metadata")


def _bare_sharded(trained, tmp_path):
    data, ck = trained
    bare = tmp_path / "bare"
    (bare / "dcp").mkdir(parents=True)
    for n in ("config.json", "model.safetensors", "trainer.json"):
        shutil.copy(ck / "step-000001" / n, bare / (n if n != "trainer.json"
                                                    else "treeflow_trainer.json"))
    _evil_pickle(bare / "dcp" / ".metadata", tmp_path / "pwned")
    return data, bare


def test_a_bare_dcp_directory_is_refused_unless_trusted(trained, tmp_path, capsys):
    data, bare = _bare_sharded(trained, tmp_path)
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", bare)
    assert not (tmp_path / "pwned").exists(), "resuming ran the pickled DCP index"
    refused(rc, err, str(bare), "no manifest.json", "--trust-checkpoint")
    # trusted, it is read -- by the safe reader, which still builds nothing but DCP metadata
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", bare,
                     "--trust-checkpoint")
    assert not (tmp_path / "pwned").exists(), "--trust-checkpoint ran the pickled DCP index"
    refused(rc, err, ".metadata", "not DCP metadata")


def test_an_old_layout_checkpoint_needs_trust_and_still_runs_no_code(trained, tmp_path, capsys):
    data, ck = trained
    old = tmp_path / "old"
    old.mkdir()
    for n in ("config.json", "model.safetensors"):
        shutil.copy(ck / "step-000001" / n, old / n)
    torch.save({"optimizer": _Payload(str(tmp_path / "pwned")), "steps": 1,
                "scheduler_episodes": 2, "position": {"episodes": 2}}, old / "trainer_state.pt")
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", old)
    refused(rc, err, str(old), "trainer_state.pt", "--trust-checkpoint")
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", old,
                     "--trust-checkpoint")
    assert not (tmp_path / "pwned").exists()
    refused(rc, err, "trainer_state.pt")


def _dcp_dir(tmp_path, extra=None):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = {"w": model.weight.detach().clone(), "lr": 0.25, **(extra or {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    return tmp_path / "dcp", state


def test_dcp_items_of_plain_values_load_and_code_in_one_is_refused(tmp_path):
    from treeflow.train import dcp_safe

    path, state = _dcp_dir(tmp_path)
    got = {"w": torch.zeros(3, 4), "lr": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_safe.load(got, path)
    assert torch.equal(got["w"], state["w"]) and got["lr"] == 0.25  # a real DCP round trip
    # a non-tensor item whose bytes are a pickle of code (torch.save'd by the writer)
    bad, _ = _dcp_dir(tmp_path / "b", {"lr": _Payload(str(tmp_path / "pwned"))})
    with pytest.raises(ValueError, match=r"DCP item 'lr': refused"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_safe.load({"w": torch.zeros(3, 4), "lr": None}, bad)
    assert not (tmp_path / "pwned").exists(), "a DCP bytes item ran code"


def test_a_dcp_index_pointing_outside_its_directory_is_refused(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from treeflow.train import dcp_safe

    path, _ = _dcp_dir(tmp_path)
    md = dcp_safe.read_metadata(path)
    key = next(iter(md.storage_data))
    md.storage_data[key] = _StorageInfo("../../etc/passwd", 0, 10)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        dcp_safe.read_metadata(path)


def test_a_dcp_index_that_edits_an_allowed_class_is_refused(tmp_path):
    # only allowlisted names, but BUILD on the class itself: plain pickle would set a class
    # attribute of DCP's metadata for the whole process
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from treeflow.train import dcp_safe

    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(
        b"ctorch.distributed.checkpoint.metadata\nBytesStorageMetadata\n(N}Vpwned\nI1\nstb.")
    with pytest.raises(ValueError, match="sets the state of a type"):
        dcp_safe.read_metadata(tmp_path / "dcp")
    assert not hasattr(BytesStorageMetadata, "pwned")
