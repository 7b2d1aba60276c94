"""The `treeflow` command line, one module per command group, no import cycles.

    main.py          the parser assembled from the command modules; `main(argv)`
    replay.py        replay --mode logprobs          train.py         --mode train (fit())
    stream.py        stream, rollout                 stream_train.py  stream --mode train
    stream_logprobs.py  stream --mode logprobs (per-step files, acks after writes)
    plan.py          synth, inspect, plan            convert.py       convert
    gate.py          gate
    groups.py        the option groups (--help headings and --config keys), the help formatter
    options.py       the options shared by commands, each in its group (model, train, loss,
                     logger, queue, sampling, ...)
    parallel.py      --tensor-parallel / --context-parallel: the flags (what they refuse and
                     which processes run: train/launch_plan.py `Launch`)
    configs.py       parsed flags -> the stage configs a Python user writes (Forward, Reduce,
                     each rank's Pack/Fragment/Shard and training pipeline, Files), fit()'s
                     Checkpointer and sinks, the Launch; what the commands compute lives in
                     the library (pipeline/rank_plan.py, stats.py, tools/synth.py,
                     programs/gate.py, models/tuning.py, train/launch.py, train/)
    config.py        --config FILE, --print-config      names.py  old flag names, refused
    help.py          the conventions applied to every subcommand    common.py, queue.py, rl.py

Command modules import the shared ones, never `main` or each other (replay -> train and
stream -> stream_logprobs, stream_train excepted); tests/test_layering.py holds the whole
package to no cycles.
"""

from treeflow.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
