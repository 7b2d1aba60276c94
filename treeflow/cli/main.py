"""`treeflow` command line: synth, convert, inspect, plan, replay, stream, rollout, gate.

Each command is a thin shell over the library: it parses options, streams
windows of episodes through stages, and prints a summary (rich tables, or one
JSON object with --json). Progress goes to stderr so that stdout stays clean;
--quiet prints nothing but errors. This module only assembles the parser from
the command modules and runs the chosen command; nothing imports it back.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading

import treeflow._clock  # noqa: F401  where /proc is absent, the process clock starts here
from treeflow.cli.convert import add_convert_parser
from treeflow.cli.gate import add_gate_parser
from treeflow.cli.plan import add_plan_parsers, add_synth_parser
from treeflow.cli.replay import add_replay_parser
from treeflow.cli.stream import add_stream_parsers

__all__ = ["build_parser", "entry", "main"]


def build_parser() -> argparse.ArgumentParser:
    from treeflow.cli.trackers import add_verbose_option

    p = argparse.ArgumentParser(prog="treeflow", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks (or TREEFLOW_DEBUG=1)")
    add_verbose_option(p)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks (or TREEFLOW_DEBUG=1)")
    add_verbose_option(common)
    sub = p.add_subparsers(dest="command", required=True)
    add_synth_parser(sub, common)
    add_convert_parser(sub)
    add_replay_parser(sub, common)
    add_stream_parsers(sub, common)
    add_gate_parser(sub, common)
    add_plan_parsers(sub, common)

    from treeflow.cli.config import add_config_flags
    from treeflow.cli.help import finish_parser

    add_config_flags(p)
    finish_parser(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from treeflow._errors import debug_wanted, run
    from treeflow.cli.config import apply_config, print_config
    from treeflow.cli.names import resolve
    from treeflow.cli.trackers import quiet_libraries

    parser = build_parser()
    args = run(lambda a: apply_config(parser, a), argv, debug=debug_wanted(
        "--debug" in (argv if argv is not None else sys.argv[1:])))
    if isinstance(args, int):  # the config file was refused (a one-line error)
        return args
    resolve(args)
    if getattr(args, "print_config", False):
        return print_config(parser, args)
    quiet_libraries(getattr(args, "verbose", False) or debug_wanted(getattr(args, "debug", False)))
    from treeflow._display import warning_lines

    warning_lines(False)  # treeflow's own warnings as one `warning: ...` line, even --verbose
    from treeflow.cli.common import cuda_allocator

    cuda_allocator(args)  # before any CUDA work: the ranks and Ray cluster it starts inherit it
    if hasattr(args, "compile_cache"):  # before torch is imported: spawned ranks inherit it
        code = run(_compile_cache, args, debug=debug_wanted(getattr(args, "debug", False)))
        if code:
            return code
    return run(args.fn, args, debug=debug_wanted(getattr(args, "debug", False)))


def entry() -> None:
    """The `treeflow` console script and `python -m treeflow.cli`: run `main`, then exit fast.

    A process that imported torch (and on a GPU made a CUDA context) spends 0.5-1 s after
    its last line tearing the interpreter down: every module's objects, the context, the
    allocator's pools. Every output is written and closed before `main` returns
    (treeflow.atomic), so once stdout and stderr are flushed and the exit handlers have run
    (Ray's shutdown, multiprocessing's joins, logging's flush; not the wait for inductor's
    compile workers, see `_no_compile_worker_wait`) the process ends with `os._exit`. While a non-daemon thread still runs, the interpreter's
    own exit waits for it as usual. `main(argv)` called from Python never exits.
    """
    code = main()
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if others:
        sys.exit(code)
    try:
        _no_compile_worker_wait()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: what was written stays lost either way
                pass
        os._exit(code if isinstance(code, int) else 1)


def _no_compile_worker_wait() -> None:
    """Leave inductor's compile workers to end themselves instead of waiting for them.

    Inductor's exit handler sends its compile-worker sidecar a shutdown and waits for it to
    stop its pool of workers: 0.7-0.8 s of a warm H200 run's 13 s (bench/profile_fixed_costs.py),
    spent after every output is written. The workers hold no result of this process (every
    kernel the run used was compiled and loaded before `main` returned; triton and inductor
    write their cache files whole, by rename), and they end by themselves once this process
    is gone: the sidecar on its closed pipe, each worker when its parent changes.
    """
    compile_workers = sys.modules.get("torch._inductor.async_compile")
    if compile_workers is not None and hasattr(compile_workers, "shutdown_compile_workers"):
        atexit.unregister(compile_workers.shutdown_compile_workers)


def _compile_cache(args) -> int:
    from treeflow.compile_cache import configure

    configure(args.compile_cache)
    return 0
