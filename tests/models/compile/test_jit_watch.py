"""Triton kernels built after the warm-up are counted by name, and the warm-up's first pass hands
builds to threads (models/compile/jit_watch.py).

Triton calls its `jit_cache_hook` before each build of a kernel specialization; on CPU (the
interpreter builds nothing) the hook is called here as Triton calls it, with keyword arguments
and the kernel as a JitFunctionInfo.
"""

import pytest

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction, JitFunctionInfo  # noqa: E402

from treeflow.models.compile import jit_watch  # noqa: E402
from treeflow.pipeline.local import _finish, _GraphCounter  # noqa: E402


def _build(name):
    """What Triton does before building `name`: call the hook; True would skip the build."""
    return knobs.runtime.jit_cache_hook(key=(name,), repr=name,
                                        fn=JitFunctionInfo(None, name, None), compile={},
                                        is_manual_warmup=False, already_compiled=False)


@pytest.fixture
def fresh(monkeypatch):
    """An uninstalled watcher and Triton's hook slot as a test left it: restored after."""
    monkeypatch.setattr(jit_watch, "_installed", False)
    monkeypatch.setattr(jit_watch, "_names", [])
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)


def test_builds_after_the_mark_are_counted_by_name(fresh):
    jit_watch.install()
    jit_watch.install()  # twice: one hook, not two (each build counted once)
    _build("_warm")
    mark = jit_watch.met()
    for name in ("_chunk_scan_fwd", "_conv_fwd", "_chunk_scan_fwd"):
        assert _build(name) is None  # never skips a build
    assert jit_watch.since(mark) == {"_chunk_scan_fwd": 2, "_conv_fwd": 1}


def test_a_hook_set_before_is_called_and_its_answer_kept(fresh):
    seen = []

    def before(**kwargs):
        seen.append(kwargs["fn"].name)
        return True  # e.g. a cache that serves the kernel: Triton skips its build
    knobs.runtime.jit_cache_hook = before
    jit_watch.install()
    assert _build("_acs_fwd") is True
    assert seen == ["_acs_fwd"] and jit_watch.since(0) == {"_acs_fwd": 1}


def test_the_pipeline_counts_only_after_a_warm_up(fresh):
    """The counter's windows: what a warmed run builds per window; nothing without a warm-up
    (CPU runs, whose first window is their warm-up)."""
    warmed = _GraphCounter(warmed=True)
    _build("_rms_norm_fwd")
    assert warmed.kernels_since_last() == {"_rms_norm_fwd": 1}
    assert warmed.kernels_since_last() == {}  # counted once, in the window that built it
    cold = _GraphCounter(warmed=False)
    _build("_rms_norm_bwd")
    assert cold.kernels_since_last() == {}


class _Window:
    """What `_finish` reads of a window's accumulator."""

    def finish(self):
        return "output"

    def stats(self):
        return {"bins": 1}


def test_a_window_says_the_kernels_it_built(fresh, capsys):
    """Each window's stats hold its builds (0 too, after a warm-up), and stderr names them in
    one line for a window that built any, none for one that did not."""
    graphs = _GraphCounter(warmed=True)
    _build("_conv_fwd")
    _build("_chunk_scan_fwd")
    _build("_conv_fwd")
    first = _finish(1, 0, 4, _Window(), {}, graphs)
    assert first.stats["kernel_builds"] == 3 and first.output == "output"
    err = capsys.readouterr().err.splitlines()
    assert err == ["treeflow: window at step 1 built 3 Triton kernel specialization(s) the "
                   "warm-up did not meet (_chunk_scan_fwd, _conv_fwd x2); their build is in "
                   "this window's seconds"], err
    second = _finish(2, 4, 4, _Window(), {}, graphs)
    assert second.stats["kernel_builds"] == 0 and capsys.readouterr().err == ""
    cold = _finish(1, 0, 4, _Window(), {}, _GraphCounter(warmed=False))
    assert "kernel_builds" not in cold.stats  # no warm-up: the first window is the warm-up


def test_a_first_pass_hook_without_a_specialization_lets_the_launch_build_it(fresh, capsys):
    """compile_ahead on a Triton whose hook says too little to build elsewhere: the launch
    builds as before (counted), and stderr says so once."""
    jit_watch._say_once.cache_clear()
    with jit_watch.compile_ahead(1) as ahead:
        assert _build("_loss_tile_stats") is None and _build("_loss_tile_grad") is None
    assert ahead.submitted == 0 and jit_watch.since(0) == {"_loss_tile_stats": 1,
                                                           "_loss_tile_grad": 1}
    assert capsys.readouterr().err.count("builds its kernels one after another") == 1


def _never_built(x_ptr):
    pass


def test_a_build_that_fails_ahead_is_named_and_left_to_the_real_pass(fresh, capsys):
    """A first-pass launch is skipped and its build handed to a thread, once per
    specialization; a build that fails there (no GPU to build for here, a failing compile on a
    GPU machine) is named on leaving,
    and the real pass builds it where its error surfaces."""
    from triton.compiler import ASTSource

    def fails(src, target=None, options=None):
        raise RuntimeError("this build fails")

    jit = JITFunction(_never_built)  # a compiled kernel's object (tests interpret ours)
    jit.ASTSource, jit.compile = ASTSource, fails  # as its first launch sets them; fails anywhere
    info = JitFunctionInfo(jit.module, "_loss_tile_stats", jit)

    def launch():
        return knobs.runtime.jit_cache_hook(
            key=("spec",), repr="", fn=info,
            compile={"signature": {"x_ptr": "*fp32"}, "device": 0, "constants": {},
                     "configs": [{}], "specialization_data": '{"options": {}}'},
            is_manual_warmup=False, already_compiled=False)

    with jit_watch.compile_ahead(2) as ahead:
        assert jit_watch.ahead()
        assert launch() is True and launch() is True  # skipped, one build handed over
    assert not jit_watch.ahead()
    assert ahead.submitted == 1 and list(ahead.failed) == ["_loss_tile_stats"]
    assert "1 Triton kernel(s) failed to build ahead (_loss_tile_stats:" in capsys.readouterr().err
    assert launch() is None  # after the pass: the launch builds it, counted
    assert jit_watch.since(0) == {"_loss_tile_stats": 1}
