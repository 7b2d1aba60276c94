"""Failures that printed a traceback (or a message naming nothing) now print one line (issue 20).

Each test failed before its fix. A full disk is a real tmpfs where the test
may mount one (root), else the write raises what the full disk raised.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import subprocess

import pyarrow as pa
import pytest
from safetensors import SafetensorError

from tests.reliability.helpers import TRAIN, cli, refused, small_episodes, tree_hashes, write_small
from treeflow.tools import write_episodes


@pytest.fixture(autouse=True)
def _hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEFLOW_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def data(tmp_path):
    return write_small(tmp_path / "e.arrow")


def resign(step_dir, edit) -> None:
    """Edit a checkpoint's trainer.json and re-sign its manifest (what a forger would do)."""
    state_path = os.path.join(step_dir, "trainer.json")
    with open(state_path) as f:
        state = json.load(f)
    edit(state)
    with open(state_path, "w") as f:
        json.dump(state, f)
    resign_file(step_dir, "trainer.json")


def resign_file(step_dir, name) -> None:
    mpath = os.path.join(step_dir, "manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    path = os.path.join(step_dir, name)
    with open(path, "rb") as f:
        blob = f.read()
    manifest["files"][name] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    with open(mpath, "w") as f:
        json.dump(manifest, f)


@contextlib.contextmanager
def full_disk(path, monkeypatch, *, kib=64):
    """A directory on a tiny tmpfs (mounted as root), or None where mounting is not allowed."""
    os.makedirs(path)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)],
                       capture_output=True)
    try:
        yield r.returncode == 0
    finally:
        if r.returncode == 0:
            subprocess.run(["umount", str(path)], check=True)


def _trainer_run(tmp_path, capsys, data):
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", ck)
    assert rc == 0, err
    return ck, ck / "step-000001"


# ---------------------------------------------------------------- --save on a full disk
def test_save_on_a_full_disk(tmp_path, capsys, data, monkeypatch):
    disk = tmp_path / "disk"
    with full_disk(disk, monkeypatch) as mounted:
        if not mounted:  # what the file system raises there (treeflow/tensorfile.py writes)
            import treeflow.tensorfile as tensorfile

            def full(fd):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            monkeypatch.setattr(tensorfile.os, "fsync", full)
        rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", disk / "ck")
        # the weights and AdamW are written at once: which file meets the full disk first
        # depends on timing; the message names that one (it named none when config.json or
        # trainer.json, written with a plain open(), met it)
        refused(rc, err, "No space left on device", str(disk / "ck"))
        assert any(f in err for f in ("model.safetensors", "optimizer.safetensors",
                                      "config.json", "trainer.json", "manifest.json")), err
        left = [n for d, _, ns in os.walk(disk) for n in ns]
        assert not left, left  # no temporary left on the full disk


def test_a_full_disk_at_a_small_checkpoint_file_names_it(tmp_path, capsys, data, monkeypatch):
    """The flake of test_save_on_a_full_disk, made to happen every time: the disk fills while
    a small JSON file of the step is written (open().write raises ENOSPC naming no file)."""
    import treeflow.train.checkpoint as checkpoint

    real = checkpoint.json.dump

    def dump(obj, f, **kw):
        if os.path.basename(f.name) == "trainer.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, **kw)
    monkeypatch.setattr(checkpoint.json, "dump", dump)
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "1", "--save", tmp_path / "ck")
    refused(rc, err, "No space left on device", "trainer.json")
    assert not [n for d, _, ns in os.walk(tmp_path / "ck") for n in ns if "step-" in d], err


def test_convert_on_a_full_disk_leaves_no_temporary(tmp_path, capsys, monkeypatch):
    line = {"episode_id": "a", "calls": [{"prompt_token_ids": list(range(1, 400)),
                                          "choices": [{"token_ids": list(range(1, 300))}]}]}
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(dict(line, episode_id=f"e{i}")) + "\n" for i in range(64)))
    disk = tmp_path / "disk"
    with full_disk(disk, monkeypatch, kib=32) as mounted:
        if not mounted:  # the last flush fails, with the temporary written and still there
            import treeflow.io.sink as sink

            def commit(tmp, path):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            monkeypatch.setattr(sink, "commit", commit)
        rc, _, err = cli(capsys, "convert", log, "-o", disk / "e.arrow", "--format", "openai",
                         "--batch-rows", "4")
        refused(rc, err, "No space left on device", "e.arrow")
        assert os.listdir(disk) == []


# ---------------------------------------------------------------- convert's JSON
@pytest.mark.parametrize("kind", ["deep", "digits"])
def test_convert_of_an_unreadable_line_names_it(tmp_path, capsys, kind):
    good = json.dumps({"episode_id": "a", "calls": [{"prompt_token_ids": [1, 2],
                                                     "choices": [{"token_ids": [3]}]}]})
    bad = ('{"episode_id": "b", "x": ' + "[" * 5000 + "]" * 5000 + "}" if kind == "deep" else
           '{"episode_id": "b", "calls": [{"prompt_token_ids": [' + "7" * 5000 + "]}]}")
    log = tmp_path / "log.jsonl"
    log.write_text(good + "\n" + bad + "\n")
    rc, _, err = cli(capsys, "convert", log, "-o", tmp_path / "e.arrow", "--format", "openai")
    refused(rc, err, "log.jsonl line 2", "nested too deeply" if kind == "deep" else "digits")
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl"]


# ---------------------------------------------------------------- re-signed checkpoints
def test_an_optimizer_tensor_of_another_shape_is_refused_at_load(tmp_path, capsys, data):
    from safetensors.torch import load_file, save_file

    ck, step = _trainer_run(tmp_path, capsys, data)
    opt = load_file(step / "optimizer.safetensors")
    key = sorted(k for k in opt if k.endswith("exp_avg"))[0]
    opt[key] = opt[key].reshape(-1)[:-1].clone()  # one value short
    save_file(opt, step / "optimizer.safetensors", metadata={"format": "pt"})
    resign_file(step, "optimizer.safetensors")
    before = tree_hashes(tmp_path)
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", ck, "--save", ck)
    refused(rc, err, "optimizer.safetensors", f"'{key}'", "has shape")
    assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("field,value,needle", [
    ("steps", "three", "'steps' is \"three\""),
    ("scheduler_episodes", -1, "'scheduler_episodes' is -1"),
    ("position", [1], "'position' is [1]"),
])
def test_a_trainer_json_field_of_the_wrong_type_is_named(tmp_path, capsys, data, field, value,
                                                         needle):
    ck, step = _trainer_run(tmp_path, capsys, data)
    resign(step, lambda s: s.update({field: value}))
    rc, _, err = cli(capsys, "replay", data, *TRAIN, "--steps", "2", "--resume", ck, "--save", ck)
    refused(rc, err, "trainer.json", needle)


# ---------------------------------------------------------------- model config
def test_nested_architectures_in_config_json(tmp_path, capsys, data):
    from treeflow.models import load_model, save_model

    m = tmp_path / "m"
    save_model(load_model("tiny"), m)
    cfg = json.loads((m / "config.json").read_text())
    cfg["architectures"] = [["LlamaForCausalLM"]]
    (m / "config.json").write_text(json.dumps(cfg))
    rc, _, err = cli(capsys, "replay", data, "--model", m, "-o", tmp_path / "o.arrow")
    refused(rc, err, "config.json", "'architectures' is [[\"LlamaForCausalLM\"]]")
    cfg["architectures"], cfg["model_type"] = None, ["llama"]
    (m / "config.json").write_text(json.dumps(cfg))
    rc, _, err = cli(capsys, "replay", data, "--model", m, "-o", tmp_path / "o.arrow")
    refused(rc, err, "config.json", "model_type")


# ---------------------------------------------------------------- truncated Arrow stream
def test_a_truncated_arrow_stream_names_the_file(tmp_path, capsys):
    t = small_episodes(6)
    path = tmp_path / "s.arrow"
    with pa.ipc.new_stream(path, t.schema) as w:
        for b in t.to_batches(max_chunksize=2):
            w.write_batch(b)
    blob = path.read_bytes()
    path.write_bytes(blob[: int(len(blob) * 0.8)])
    for argv in (["inspect", path], ["plan", path, "--max-tokens", "256"]):
        rc, _, err = cli(capsys, *argv)
        refused(rc, err, "s.arrow", "truncated")


# ---------------------------------------------------------------- --metrics that is not a log
def test_stream_resume_with_metrics_that_are_not_text(tmp_path, capsys, data):
    ck = tmp_path / "ck"
    rc, _, err = cli(capsys, "stream", "--from", data, "--mode", "train", "--episodes-per-step", "2",
                     "--steps", "1", "--save", ck, "--quiet", "--max-tokens", "256")
    assert rc == 0, err
    blob = write_small(tmp_path / "other.arrow")  # an episode file (not an input) as --metrics
    rc, _, err = cli(capsys, "stream", "--from", data, "--mode", "train", "--episodes-per-step", "2",
                     "--steps", "2", "--save", ck, "--resume", ck, "--metrics", blob, "--quiet",
                     "--max-tokens", "256")
    refused(rc, err, "--metrics", "other.arrow", "not a metrics log")


# ---------------------------------------------------------------- strict types
def _rows_with(**call_or_top):
    rows = small_episodes(4).to_pylist()
    for r in rows:
        for k, v in call_or_top.items():
            if k.startswith("call."):
                for c in r["calls"]:
                    c[k[5:]] = v(c)
            else:
                r[k] = v(r)
    return rows


@pytest.mark.parametrize("kind,needle", [
    ("token-strings", "calls[].token_ids has type list<item: string>"),
    ("token-floats", "calls[].token_ids has type list<item: double>"),
    ("int-episode-ids", "column 'episode_id' has type int64"),
    ("start-floats", "calls[].sampled_start has type double"),
])
def test_wrong_types_are_refused_with_the_cast_to_make(tmp_path, capsys, kind, needle):
    edit = {"token-strings": {"call.token_ids": lambda c: [str(t) for t in c["token_ids"]]},
            "token-floats": {"call.token_ids": lambda c: [float(t) for t in c["token_ids"]]},
            "int-episode-ids": {"episode_id": lambda r: int(r["sample_index"])},
            "start-floats": {"call.sampled_start": lambda c: float(c["sampled_start"])}}[kind]
    path = tmp_path / "w.arrow"
    t = pa.Table.from_pylist(_rows_with(**edit))  # inferred types, as a user's writer makes them
    with pa.ipc.new_file(path, t.schema) as w:
        w.write_table(t)
    rc, _, err = cli(capsys, "plan", path, "--max-tokens", "256")
    refused(rc, err, "w.arrow", needle, "does not cast")


def test_inferred_but_meaning_preserving_types_are_still_read(tmp_path, capsys):
    # int64 token ids and starts, double logprobs, int rewards: what pa.Table.from_pylist infers
    rows = _rows_with(reward=lambda r: 1)
    t = pa.Table.from_pylist(rows)
    assert t.schema.field("reward").type == pa.int64()
    path = tmp_path / "i.arrow"
    with pa.ipc.new_file(path, t.schema) as w:
        w.write_table(t)
    rc, _, err = cli(capsys, "plan", path, "--max-tokens", "256", "--quiet")
    assert rc == 0, err


def test_a_misspelled_column_is_warned_about(tmp_path, capsys):
    t = small_episodes(4)
    t = t.append_column("rewards", pa.array([1.0] * t.num_rows))
    path = tmp_path / "m.arrow"
    write_episodes(t.drop_columns(["rewards"]), path)  # a valid file without it
    with pa.ipc.new_file(path, t.schema) as w:
        w.write_table(t)
    rc, _, err = cli(capsys, "plan", path, "--max-tokens", "256", "--quiet")
    assert rc == 0, err
    assert "warning:" in err and "'rewards'" in err and "did you mean 'reward'" in err, err
    assert err.count("'rewards'") == 1  # once per file, not per batch


# ---------------------------------------------------------------- the Ray engine reads what local reads
@pytest.mark.ray
def test_ray_engine_reads_relative_paths_and_arrow_streams(ray_cluster, tmp_path, monkeypatch,
                                                           capsys):
    from treeflow.models import load_model, save_model

    monkeypatch.chdir(tmp_path)  # the cluster's workers started elsewhere
    t = small_episodes(12)   # 6 episodes (3 whole groups) per file: ids unique over both
    with pa.ipc.new_stream("s.arrow", t.schema) as w:  # stream format, as a logger writes it
        for b in t.slice(6).to_batches(max_chunksize=2):
            w.write_batch(b)
    write_episodes(t.slice(0, 6), "e.arrow")
    save_model(load_model("tiny"), "m")  # a relative model directory too
    results = {}
    for engine in ("local", "ray"):  # relative paths, an IPC file and a stream, in one run each
        rc, _, err = cli(capsys, "replay", "e.arrow", "s.arrow", "--model", "m", "--engine",
                         engine, "--episodes-per-step", "2", "-o", f"{engine}.arrow", "--quiet")
        assert rc == 0, (engine, err)
        results[engine] = pa.ipc.open_file(f"{engine}.arrow").read_all()
    assert results["local"].num_rows == t.num_rows   # every episode of both files
    assert results["ray"].equals(results["local"])
