"""Where a CLI run's fixed seconds go: cProfile of `main`, and every exit handler timed.

Runs `treeflow ARGS` in this process under cProfile (the main thread of
`main`: imports done inside it, engine start, model load, steady bins), then
the exit handlers the way `treeflow.cli.main:entry` runs them, each one timed
(atexit.register is wrapped before anything registers, so a handler registered
here cannot be unregistered). cProfile sees one thread and on an H200 host
missed the warm-up's dynamo frames: for the compile, record every thread with
py-spy (`py-spy record -f raw --threads -- python -m treeflow.cli ARGS`). Run
it after one ordinary run of the same command so the compile cache is warm:
what is left is what a second run pays.

    python bench/profile_fixed_costs.py replay E.arrow --model CKPT --device cuda --json -o o.arrow

Prints the CLI's JSON line, then to stderr the top functions by cumulative and
by own time, and the exit handlers' seconds.
"""

from __future__ import annotations

import atexit
import cProfile
import io
import os
import pstats
import sys
import time

_EXIT: list[tuple[str, float]] = []
_register = atexit.register


def _timed_register(fn, *args, **kwargs):
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _EXIT.append((name, time.perf_counter() - t0))

    timed.__wrapped__ = fn
    _register(timed, *args, **kwargs)
    return fn


def main(argv: list[str]) -> int:
    atexit.register = _timed_register
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from treeflow.cli.main import main as cli_main

    prof = cProfile.Profile()
    prof.enable()
    rc = cli_main(argv)
    prof.disable()
    sys.stdout.flush()
    for key, n in (("cumulative", 45), ("tottime", 25)):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(n)
        print(f"---- by {key}\n" + "\n".join(text.getvalue().splitlines()[6:]), file=sys.stderr)
    t0 = time.perf_counter()
    atexit._run_exitfuncs()
    total = time.perf_counter() - t0
    print(f"---- exit handlers: {total:.3f} s", file=sys.stderr)
    for name, s in sorted(_EXIT, key=lambda x: -x[1])[:15]:
        print(f"{s:8.3f}  {name}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    main(sys.argv[1:])
