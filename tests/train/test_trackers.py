"""--logger wandb / mlflow: offline runs read back with the trackers' own readers.

wandb writes its offline run to a .wandb transaction log (LevelDB log blocks of
wandb's protobuf `Record`s); the test reads it with wandb's own proto classes.
MLflow writes a local file store that MlflowClient reads back. Resume must
continue the same tracker run and never log a step twice.
"""

import json
import struct

import pytest

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("d") / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 2), system_tokens=8,
                                  user_tokens=(2, 3), completion_tokens=(2, 3), tool_tokens=(2, 3),
                                  seed=3), path)
    return str(path)


def train(data, *extra):
    assert main(["replay", data, "--mode", "train", "--episodes-per-step", "2", "--lr", "1e-2",
                 "--loss", "nll", "--max-tokens", "256", "--json", *extra]) == 0


def wandb_history(root) -> dict[str, list[dict]]:
    """{run id: its history rows} of every offline run under `root` (all its run files)."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = {}
    for path in sorted(root.rglob("run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, buf, block = 7, b"", 32768
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            buf += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST: a whole record
                record = pb.Record()
                record.ParseFromString(buf)
                buf = b""
                if record.WhichOneof("record_type") == "run":
                    runs.setdefault(record.run.run_id, [])
                    run_id = record.run.run_id
                    config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
                    runs.setdefault("config:" + run_id, []).append(config)
                elif record.WhichOneof("record_type") == "history":
                    runs[run_id].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                         for i in record.history.item})
    return runs


def test_wandb_and_mlflow_log_every_step_once_across_resume(data, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for its file store
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    uri = f"file:{tmp_path / 'mlruns'}"
    ckpt = tmp_path / "ck"
    common = ["--logger", "wandb", "--logger", "mlflow,console", "--mlflow-tracking-uri", uri,
              "--logger-project", "proj", "--logger-run-name", "first",
              "--metrics", str(tmp_path / "m.jsonl")]
    train(data, "--steps", "2", "--save", str(ckpt), *common)
    record = json.loads((ckpt / "trackers.json").read_text())
    assert record["wandb"]["last_step"] == record["mlflow"]["last_step"] == 2
    # a killed run logged step 3 to the trackers past its checkpoint at step 2
    record["wandb"]["last_step"] = record["mlflow"]["last_step"] = 3
    (ckpt / "trackers.json").write_text(json.dumps(record))
    capsys.readouterr()
    train(data, "--steps", "4", "--resume", str(ckpt), "--save", str(ckpt), *common)
    err = capsys.readouterr().err
    assert "steps 3-3 were already logged" in err
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    runs = wandb_history(tmp_path / "wandb")
    ids = [k for k in runs if not k.startswith("config:")]
    assert ids == [record["wandb"]["run_id"]]  # the resumed run continued the same run id
    history = runs[ids[0]]
    assert [h["_step"] for h in history] == [1, 2, 4]  # step 3 once (the killed run's)
    for h in history:  # namespaced as verl / NeMo RL log them, never the old flat names
        assert h["train/loss"] == pytest.approx(rows[h["_step"] - 1]["train/loss"])
        assert h["train/grad_norm"] == pytest.approx(rows[h["_step"] - 1]["train/grad_norm"])
        assert h["perf/bins"] == rows[h["_step"] - 1]["perf/bins"]
        assert not [k for k in h if "/" not in k and not k.startswith("_")], h
    assert runs["config:" + ids[0]][0]["lr"] == 1e-2  # the resolved config, as the run config

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("proj")
    found = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in found] == [record["mlflow"]["run_id"]]
    assert found[0].info.run_name == "first" and found[0].data.params["lr"] == "0.01"
    losses = client.get_metric_history(record["mlflow"]["run_id"], "train/loss")
    assert [m.step for m in losses] == [1, 2, 4]
    assert [m.value for m in losses] == pytest.approx([rows[s - 1]["train/loss"] for s in (1, 2, 4)])
    logged = client.get_run(record["mlflow"]["run_id"]).data.metrics
    assert "train/grad_norm" in logged and not [k for k in logged if "/" not in k], logged


def test_logger_names_and_needs_are_one_line_errors(data, tmp_path, capsys):
    assert main(["replay", data, "--mode", "train", "--episodes-per-step", "2",
                 "--logger", "neptune"]) == 2
    assert "--logger neptune: not a logger" in capsys.readouterr().err
    for name, flag in (("jsonl", "--metrics FILE"), ("tensorboard", "--tensorboard DIR")):
        # the logs these names stood for are written by their flags alone: the name did nothing
        assert main(["replay", data, "--mode", "train", "--episodes-per-step", "2",
                     "--logger", f"wandb,{name}"]) == 2
        err = capsys.readouterr().err
        assert err == (f"error: --logger {name}: the {name} log is written by {flag} alone "
                       f"(--logger {name} switched nothing on); drop it from --logger\n"), err


def test_missing_package_names_the_extra(monkeypatch):
    import importlib.util

    from treeflow.train.trackers import require

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'treeflow\[wandb\]'"):
        require("wandb")


def test_stream_training_logs_to_mlflow(data, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for its file store

    uri = f"file:{tmp_path / 'mlruns'}"
    assert main(["stream", "--from", data, "--mode", "train", "--episodes-per-step", "2", "--steps",
                 "2", "--loss", "nll", "--max-tokens", "256", "--logger", "mlflow",
                 "--mlflow-tracking-uri", uri, "--metrics", str(tmp_path / "m.jsonl"),
                 "--json"]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("treeflow").experiment_id])
    for key in ("train/loss", "rollout/queue_step"):  # the stream's own fields too
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == \
            [(r["step"], pytest.approx(r[key])) for r in rows]


@pytest.mark.multiprocess
def test_two_ranks_log_once(data, tmp_path, monkeypatch, capsys):
    """--num-ranks 2: rank 0 alone logs (one MLflow run, each step once); rank 1 opens nothing."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    train(data, "--steps", "2", "--num-ranks", "2", "--logger", "mlflow", "--mlflow-tracking-uri", uri)
    capsys.readouterr()
    client = MlflowClient(tracking_uri=uri)
    # every experiment: two ranks racing to create "treeflow" could make two of that name
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    history = client.get_metric_history(runs[0].info.run_id, "perf/ranks")
    assert [(m.step, m.value) for m in history] == [(1, 2), (2, 2)]


@pytest.mark.parametrize("order", ["online first", "offline first"])
def test_wandb_starts_in_one_process_each_read_their_own_mode(data, tmp_path, monkeypatch, order):
    """wandb caches its settings process-wide: a refused online start (no API key) made a later
    offline run in the same process ask for a key, and an offline run made a later keyless
    online start run offline instead of being refused. The suite passed or failed by which
    tests shared a worker; each start now reads its own mode, in either order."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HOME", "WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.setenv(name, str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    argv = ["replay", data, "--mode", "train", "--episodes-per-step", "2", "--lr", "1e-2",
            "--loss", "nll", "--max-tokens", "256", "--steps", "1", "--logger", "wandb"]

    def online_refused():
        monkeypatch.delenv("WANDB_MODE", raising=False)
        assert main(argv) == 2  # refused: no API key

    def offline_runs():
        monkeypatch.setenv("WANDB_MODE", "offline")
        assert main(argv) == 0

    steps = [online_refused, offline_runs, online_refused]
    for step in steps if order == "online first" else steps[1:]:
        step()
