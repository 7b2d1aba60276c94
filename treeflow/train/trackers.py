"""Experiment trackers as metrics sinks: Weights & Biases and MLflow (fit()'s sink protocol).

Each tracker is one sink of train/sinks.py's protocol (`open`, `write`, `flush`,
`close`), so fit() writes every step's row to it as to the JSON-lines file and
only the lead process (rank 0, the Ray driver) ever logs. The resolved
configuration goes in once, as the wandb run config / MLflow params.

Resume: the tracker's run id and the last step it logged are kept in
`trackers.json` in the checkpoint directory (--save), rewritten atomically
after every logged step. A resumed run (--resume DIR) reads DIR's record,
continues the same wandb run id / MLflow run, and logs only the steps after
both the checkpoint's step and the last step the tracker already holds: a
tracker cannot take a step back (wandb refuses a step below its current one;
MLflow would keep two values per step), so the steps a killed run logged past
its checkpoint keep their first values, and the run says so on stderr. The
trade-off: one small file write per step, in exchange for never a doubled
step and never a second run for one training.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from treeflow._json import load as load_json

__all__ = ["MlflowSink", "TRACKERS_RECORD", "WandbSink", "require"]

TRACKERS_RECORD = "trackers.json"

_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def require(name: str) -> None:
    """Refuse --logger NAME when its package is missing, naming the pip extra (one line)."""
    import importlib.util

    module, extra = _PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"--logger {name}: the {module!r} package is not installed; "
                         f"pip install 'treeflow[{extra}]'")


def numbers(row: dict) -> dict[str, float]:
    """The row's finite numbers (bools as 0/1); strings, None and NaN are not metrics."""
    out = {}
    for k, v in row.items():
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = v
    return out


def _read_record(directory: str | None) -> dict:
    if not directory:
        return {}
    path = os.path.join(directory, TRACKERS_RECORD)
    try:
        record = load_json(path)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume {directory}: {path} is not a tracker record ({e}); remove "
                         "it to start new tracker runs") from None
    if not isinstance(record, dict):
        raise ValueError(f"--resume {directory}: {path} is not a tracker record (not a JSON "
                         "object); remove it to start new tracker runs")
    return record


def _write_record(directory: str, name: str, entry: dict) -> None:
    from treeflow.atomic import atomic_open

    os.makedirs(directory, exist_ok=True)
    record = _read_record(directory)
    record[name] = entry
    with atomic_open(os.path.join(directory, TRACKERS_RECORD)) as f:
        json.dump(record, f, indent=1)


START_TIMEOUT_ENV = "TREEFLOW_TRACKER_TIMEOUT"
START_TIMEOUT_S = 60.0  # wandb.init waits up to 90 s, MLflow retries a dead server for minutes


def _started(name: str, start, fix: str):
    """`start()` within the start-up deadline; ValueError naming the tracker and the fix when
    it raises or gives no answer in time (it then keeps trying in a daemon thread that the
    process's exit ends; the run never starts without its tracker)."""
    import threading

    limit = float(os.environ.get(START_TIMEOUT_ENV) or START_TIMEOUT_S)
    out: dict = {}

    def run():
        try:
            out["id"] = start()
        except BaseException as e:  # noqa: BLE001 - a tracker's own errors, reported below
            out["error"] = e

    t = threading.Thread(target=run, name=f"treeflow-{name}-start", daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        raise ValueError(f"--logger {name}: no answer from the tracker within {limit:g} s; "
                         f"{fix} ({START_TIMEOUT_ENV}=SECONDS to wait longer)")
    e = out.get("error")
    if e is not None:
        if isinstance(e, (ValueError, KeyboardInterrupt)) and not type(e).__module__.startswith(
                ("wandb", "mlflow")):
            raise e
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"--logger {name}: could not start a run ({type(e).__name__}: "
                         f"{first}); {fix}") from e
    return out["id"]


def _reachable(uri: str | None, fix: str, timeout: float = 10.0) -> None:
    """An http(s) tracking URI's host accepts a connection (MLflow's client would retry a
    refused one with backoff for minutes, printing nothing)."""
    import socket
    from urllib.parse import urlsplit

    if not uri or not uri.startswith(("http://", "https://")):
        return
    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise ValueError(f"--logger mlflow: cannot reach {parts.hostname}:{port} "
                         f"({e.strerror or e}); {fix}") from None


class _Tracker:
    """What both trackers share: the resume record, the steps to skip, the stderr notes."""

    name = ""

    def __init__(self, *, project: str, run_name: str | None, config: dict | None,
                 save: str | None, resume: str | None, log=None):
        self.project, self.run_name, self.config = project, run_name, dict(config or {})
        self.save, self.resume = save, resume
        self.log = log or (lambda m: print(m, file=sys.stderr))
        self.run_id, self.last, self.skip_to, self._skipped = None, 0, 0, []

    def open(self, *, steps_done: int, resuming: bool) -> None:
        saved = _read_record(self.resume).get(self.name) if resuming else None
        if resuming and saved is None:
            self.log(f"--logger {self.name}: {self.resume} holds no {self.name} run to continue "
                     f"({TRACKERS_RECORD}); starting a new one")
        self.last = int(saved.get("last_step", 0)) if saved else 0
        self.skip_to = max(steps_done, self.last)
        self.run_id = _started(self.name, lambda: self._start(saved.get("run_id") if saved
                                                             else None), self._where())
        self._remember()

    def write(self, row: dict, position: dict | None) -> None:
        step = row.get("step")
        if not isinstance(step, int):
            return
        if step <= self.skip_to:  # already in the tracker: a tracker step is written once
            self._skipped.append(step)
            return
        from treeflow.train.metric_names import logged

        self._note_skipped()
        metrics = numbers(logged(row))  # train/loss, rollout/gen_kl, perf/bins
        if position and isinstance(position.get("episodes"), int):
            metrics["train/episodes_consumed"] = position["episodes"]
        metrics.pop("step", None)
        self._log(step, metrics)
        self.last = step
        self._remember()

    def flush(self, *, durable: bool = False) -> None:
        pass

    def close(self) -> None:
        self._note_skipped()
        if self.run_id is not None:
            self._finish()
            self.run_id = None

    def _note_skipped(self) -> None:
        if self._skipped:
            self.log(f"--logger {self.name}: steps {self._skipped[0]}-{self._skipped[-1]} were "
                     "already logged by the interrupted run (past its checkpoint); not logged "
                     "again, the tracker keeps their first values")
            self._skipped = []

    def _where(self) -> str:
        return ""

    def _remember(self) -> None:
        if self.save:
            _write_record(self.save, self.name, {"run_id": self.run_id, "last_step": self.last})


class WandbSink(_Tracker):
    """Weights & Biases: one run per training (WANDB_MODE=offline writes it locally)."""

    name = "wandb"

    def __init__(self, *, directory: str | None = None, **kw):
        super().__init__(**kw)
        self.directory, self._run = directory, None

    def _where(self) -> str:
        return ("set WANDB_API_KEY or run `wandb login`, or run with WANDB_MODE=offline "
                "(synced later with `wandb sync`)")

    def _start(self, run_id: str | None) -> str:
        import wandb

        if self.directory:
            os.makedirs(self.directory, exist_ok=True)
        # wandb caches its settings process-wide at the first start: a later start in this
        # process (an offline run after a refused online one, or the reverse) would get the
        # old mode. With no run of the caller's open, start from fresh settings; WANDB_MODE is
        # read now either way.
        if wandb.run is None:
            wandb.teardown()
        mode = {"mode": os.environ["WANDB_MODE"]} if os.environ.get("WANDB_MODE") else {}
        try:
            self._run = wandb.init(project=self.project, name=self.run_name, id=run_id,
                                   resume="allow" if run_id else None,
                                   dir=self.directory, config=self.config,
                                   settings=wandb.Settings(silent=True, console="off", **mode))
        except BaseException:
            wandb.teardown()  # a failed start leaves no process-wide state behind
            raise
        return self._run.id

    def _log(self, step: int, metrics: dict) -> None:
        self._run.log(metrics, step=step)

    def _finish(self) -> None:
        self._run.finish()
        self._run = None


class MlflowSink(_Tracker):
    """MLflow: one run per training in experiment `project` at `tracking_uri`."""

    name = "mlflow"

    def __init__(self, *, tracking_uri: str | None = None, **kw):
        super().__init__(**kw)
        self.tracking_uri, self._client = tracking_uri, None

    def _uri(self) -> str | None:
        return self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")

    def _where(self) -> str:
        return (f"check --mlflow-tracking-uri {self._uri()} (is the server up and reachable "
                "from here?)" if self._uri() else "check MLflow's setup")

    def _start(self, run_id: str | None) -> str:
        uri = self._uri()
        _reachable(uri, self._where())
        if uri and (uri.startswith("file:") or "://" not in uri):
            # MLflow 3 refuses its file store unless asked; a file: URI given here is the ask
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            return run_id
        experiment = client.get_experiment_by_name(self.project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(self.project))
        run = client.create_run(experiment_id, run_name=self.run_name)
        params = [Param(k, json.dumps(v)[:6000]) for k, v in sorted(self.config.items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run.info.run_id, params=params[i:i + 100])
        return run.info.run_id

    def _log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step)
                                                     for k, v in metrics.items()])

    def _finish(self) -> None:
        self._client.set_terminated(self.run_id)
