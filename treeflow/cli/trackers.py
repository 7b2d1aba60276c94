"""The CLI's logging flags: --logger (trackers as fit() sinks) and --verbose (library logs).

`sinks_from_args(args)` turns --logger, --logger-project, --logger-run-name, --logger-dir
and --mlflow-tracking-uri (options.py) (with --metrics and --tensorboard) into
the sinks fit() writes every step to. The names follow NeMo RL's logger
config (wandb.project / wandb.name, mlflow.experiment_name / run_name /
tracking_uri, log_dir) and verl's `trainer.logger=['console','wandb']`.

`quiet_libraries(verbose)` runs before any library is imported: Ray's
startup lines and worker echo, Ray Data's progress bars, transformers' and
the Hub's progress bars and advisories, and Python warnings raised from
library code are off on stderr unless --verbose (or --debug). treeflow's own
warnings and notes are never hidden: the warning filter drops only warnings
attributed to a module outside treeflow. The trade-off: environment defaults
(the user's own settings win) so spawned ranks and Ray workers inherit them.
"""

from __future__ import annotations

import os

from treeflow._display import QUIET_ENV, warning_lines

__all__ = ["LOGGERS", "add_verbose_option", "quiet_libraries", "sinks_from_args"]

LOGGERS = ("console", "wandb", "mlflow")
# names --logger took that switched nothing on: their logs are written by these flags alone
_BY_FLAG = {"jsonl": "--metrics FILE", "tensorboard": "--tensorboard DIR"}


def add_verbose_option(parser) -> None:
    import argparse

    parser.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show Ray's, transformers' and other libraries' logs, progress "
                             "bars and warnings (hidden by default; treeflow's are always shown)")


def loggers(args) -> list[str]:
    """The --logger names, in order, each once; a name treeflow does not know is refused."""
    names = []
    for item in getattr(args, "logger", None) or []:
        for name in str(item).split(","):
            name = name.strip().lower()
            if not name:
                continue
            if name in _BY_FLAG:
                raise ValueError(f"--logger {name}: the {name} log is written by "
                                 f"{_BY_FLAG[name]} alone (--logger {name} switched nothing "
                                 "on); drop it from --logger")
            if name not in LOGGERS:
                raise ValueError(f"--logger {name}: not a logger; choose from "
                                 + ", ".join(LOGGERS))
            if name not in names:
                names.append(name)
    return names


def sinks_from_args(args, log=None) -> list:
    """fit()'s sinks: --metrics, --tensorboard and each tracker named by --logger."""
    from treeflow.cli.config import resolved_config
    from treeflow.train.sinks import JsonlSink, TensorBoardSink
    from treeflow.train.trackers import MlflowSink, WandbSink, require

    names = loggers(args)
    sinks = [*([JsonlSink(args.metrics)] if args.metrics else []),
             *([TensorBoardSink(args.tensorboard)] if args.tensorboard else [])]
    common = dict(project=args.logger_project, run_name=args.logger_run_name,
                  config=resolved_config(args), save=args.save, resume=args.resume, log=log)
    for name in names:
        if name == "wandb":
            require(name)
            sinks.append(WandbSink(directory=args.logger_dir, **common))
        elif name == "mlflow":
            require(name)
            sinks.append(MlflowSink(tracking_uri=args.mlflow_tracking_uri, **common))
    return sinks


def quiet_libraries(verbose: bool) -> None:
    """Libraries' logs off on stderr (before they are imported); nothing when verbose."""
    if verbose:
        return
    for key, value in (("RAY_LOGGER_LEVEL", "error"),  # "Started a local Ray instance", ...
                       ("RAY_DATA_DISABLE_PROGRESS_BARS", "1"),
                       ("RAY_DEDUP_LOGS", "1"),
                       ("TRANSFORMERS_VERBOSITY", "error"),
                       ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
                       ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("TQDM_DISABLE", "1")):  # "Writing model shards", "Loading weights"
        os.environ.setdefault(key, value)
    os.environ[QUIET_ENV] = "1"  # Ray Data's logger, spawned ranks' and Ray actors' warnings
    # a warning attributed to a library's module (torch.jit deprecations, megatron's Apex
    # notes); treeflow's own, and those raised at treeflow's call sites, still show
    warning_lines(True)
