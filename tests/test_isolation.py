"""The leak detector of tests/isolation.py names each piece of state a test leaves changed, and
puts it back; what an in-process command sets for its process on purpose is put back silently.

Each case changes one piece of state between `snapshot()` and `check()` (the conftest fixture
does the same around every test), so a detector that stopped reading a piece fails here.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import warnings

import pytest
import torch

from tests import isolation


def _set_env():
    os.environ["TREEFLOW_LEAK_PROBE"] = "1"


def _dynamo():
    import torch._dynamo.config as c

    c.recompile_limit = c.recompile_limit + 1


def _inductor():
    import torch._inductor.config as c

    c.compile_threads = 3


def _functorch():
    import torch._functorch.config as c

    c.donated_buffer = not c.donated_buffer


def _lock(tmp_path):
    from treeflow.lock import claim_output

    claim_output(str(tmp_path / "out"), option="--out")


LEAKS = {  # what a test does -> what the detector must name
    "env": (_set_env, "TREEFLOW_LEAK_PROBE"),
    "sys.path": (lambda: sys.path.insert(0, "/leak-probe"), "sys.path"),
    "cwd": (lambda: os.chdir(os.path.dirname(os.getcwd())), "cwd"),
    "dtype": (lambda: torch.set_default_dtype(torch.float64), "torch.get_default_dtype()"),
    "grad": (lambda: torch.set_grad_enabled(False), "torch.is_grad_enabled()"),
    "deterministic": (lambda: torch.use_deterministic_algorithms(True),
                      "torch.are_deterministic_algorithms_enabled()"),
    "anomaly": (lambda: torch.autograd.set_detect_anomaly(True), "torch.is_anomaly_enabled()"),
    "matmul": (lambda: torch.set_float32_matmul_precision("medium"),
               "torch.get_float32_matmul_precision()"),
    "dynamo": (_dynamo, "torch._dynamo.config {recompile_limit"),
    "inductor": (_inductor, "torch._inductor.config {compile_threads"),
    "functorch": (_functorch, "torch._functorch.config {donated_buffer"),
    "logger level": (lambda: logging.getLogger("treeflow.leak_probe").setLevel(logging.DEBUG),
                     "treeflow.leak_probe"),
    "root handler": (lambda: logging.getLogger().addHandler(logging.NullHandler()), "<root>"),
    "signal": (lambda: signal.signal(signal.SIGUSR1, lambda *a: None), "SIGUSR1"),
    "excepthook": (lambda: setattr(sys, "excepthook", lambda *a: None), "sys.excepthook"),
    "thread hook": (lambda: setattr(threading, "excepthook", lambda *a: None),
                    "threading.excepthook"),
    "recursion": (lambda: sys.setrecursionlimit(sys.getrecursionlimit() - 7),
                  "sys.getrecursionlimit()"),
    "start method": (lambda: multiprocessing.set_start_method("spawn", force=True),
                     "multiprocessing start method"),
}


@pytest.mark.parametrize("name", list(LEAKS) + ["output lock"])
def test_each_leak_is_named_and_put_back(name, tmp_path):
    before = isolation.snapshot()
    if name == "output lock":
        _lock(tmp_path)
        names = "treeflow.lock._held"
    else:
        leak, names = LEAKS[name]
        leak()
    leaks = isolation.check(before)
    assert len(leaks) == 1 and names in leaks[0], leaks
    assert isolation.check(isolation.snapshot()) == []
    after = isolation.snapshot()
    for key in ("env", "sys.path", "cwd", "torch", "signals", "hooks"):
        assert after[key] == before[key], key  # put back
    for key in ("configs", "loggers"):  # what an import made during the case is not compared
        assert {k: v for k, v in after[key].items() if k in before[key]} == before[key], key


def test_what_a_command_sets_for_its_process_is_put_back_silently():
    """The CLI's main() quiets libraries through the environment, formats warnings as one line,
    and treeflow warns once per process: a later test gets them as a fresh process has them."""
    from treeflow.cli.trackers import quiet_libraries
    from treeflow.models.attention import context_parallel

    before = isolation.snapshot()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        context_parallel._warn_blocking("probe", "probe")
    assert context_parallel._warn_blocking.cache_info().currsize == 1
    format_before = warnings.formatwarning
    quiet_libraries(False)
    assert os.environ.get("TREEFLOW_QUIET_LIBRARIES") == "1"
    assert warnings.formatwarning is not format_before
    assert isolation.check(before) == []
    assert warnings.formatwarning is format_before
    assert context_parallel._warn_blocking.cache_info().currsize == 0
    assert {k: os.environ.get(k) for k in isolation.RESTORED_ENV} \
        == {k: before["env"].get(k) for k in isolation.RESTORED_ENV}


def test_what_a_library_sets_as_it_is_imported_is_no_leak():
    """`import ray` puts its vendored packages on sys.path and polars its allocator's settings
    in the environment: not undone by a later import, so neither put back nor a leak."""
    vendored = os.path.join(os.path.dirname(os.__file__), "site-packages", "probe", "vendored")
    before = isolation.snapshot()
    sys.path.append(vendored)
    os.environ["_RJEM_MALLOC_CONF"] = "probe"
    try:
        assert isolation.check(before) == []
        assert vendored in sys.path
    finally:
        sys.path.remove(vendored)
        if before["env"].get("_RJEM_MALLOC_CONF") is None:
            del os.environ["_RJEM_MALLOC_CONF"]
        else:
            os.environ["_RJEM_MALLOC_CONF"] = before["env"]["_RJEM_MALLOC_CONF"]
