"""A warm-up's AOTInductor builds run side by side (compile/build_pool.py, issue 46).

On CPU through inductor's C++ (ahead of time forced, as tests/models/compile/test_aoti.py): a
2-layer decoder's two parts (attention_inputs, after_attention) are built once in a serial run
and once inside `build_pool.together()`. Their C++ compilers must run at once -- the first
compile waits until another build's compiler starts, so a pool that runs them one after another
fails that build instead of passing by luck of timing -- and the graphs built side by side give
the serial builds' hidden states bit for bit, both within float32 rounding of the plain (eager)
path. A failing build is said by name, built again alone and recorded while the other still
builds; the caller's inductor config holds in the pool's threads; leaving the pool waits for
every build even when the warm-up raised, and every owner even when one fails (the first error
raised, from the body's); a call with no pool in force waits for its graph; warm-ups in two
threads keep their own pools; builds run on the submitting thread's CUDA device (two GPUs);
builds whose compile sessions end out of order leave torch.compiler.is_compiling() as found.
"""

from __future__ import annotations

import glob
import os
import threading
import time

import numpy as np
import pytest
import torch

from tests.test_compile_cache_precompiled import configured, with_headers
from treeflow import compile_cache
from treeflow.models import ModelConfig
from treeflow.models.compile import aoti, build_pool

HANG_S = 300.0  # bounds a hang only: a wait below ends as soon as what it waits for happens
_CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def _module_cache(tmp_path_factory, shared_headers):
    return with_headers(tmp_path_factory.mktemp("build_pool") / "cache", shared_headers)


@pytest.fixture
def cache(_module_cache):
    """One compile cache for the module's builds outside a pool of their own making, as a
    user's cache is kept, its precompiled headers the session's (`shared_headers`: two g++
    runs, ~13 s of CPU, made once). The packages are each test's own (the serial decoder parts,
    fails_in_pool and builds_in_pool, waits), so no test loads another's build; the side-by-side
    builds still make their headers in a new directory of their own, inside the pool."""
    yield from configured(_module_cache)


def _hidden(model, n: int):
    from treeflow.models.attention.tree import AttentionPlan
    from treeflow.tree import subtree_end

    depth = np.arange(n)  # one chain: an exact bin
    dev = next(model.parameters()).device
    plan = AttentionPlan(subtree_end(depth), kernel="runs", parents_N=np.arange(-1, n - 1),
                         device=dev)
    with torch.no_grad():
        return model(torch.arange(n, device=dev) % 512, torch.from_numpy(depth).to(dev), plan)


def _ops(monkeypatch, device: str = "cpu"):
    from treeflow.models.compile.layer_ops import LayerOps
    from treeflow.models.reference import decoder

    # ahead of time on CPU forced (C++ kernels); on CUDA the default route (Triton kernels)
    ops = LayerOps(compile_backend="inductor", recompute="none",
                   ahead_of_time=True if device == "cpu" else None)
    monkeypatch.setattr(decoder, "layer_ops", lambda tuning, device: ops)
    return ops


def _built(ops) -> dict:
    return {p.name: p.aoti_captured for p in (ops._inputs, ops._output, ops._mlp, ops._after)
            if p.aoti_captured}


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_warm_up_builds_run_side_by_side_and_equal_the_serial_builds_bit_for_bit(
        cache, tmp_path, monkeypatch, device):
    from treeflow.models.checkpoint import seeded_decoder

    model = seeded_decoder(_CFG, device=device, dtype=torch.float32)
    counts = (64, 23)  # two token counts: one graph per part serves both
    plain = {n: _hidden(model, n) for n in counts}  # the reference: eager layers

    serial_ops = _ops(monkeypatch, device)  # in the module's cache (the fixture's)
    serial = {n: _hidden(model, n) for n in counts}  # each part built in its first call
    assert _built(serial_ops) == {"attention_inputs": 1, "after_attention": 1}

    compile_cache.configure(tmp_path / "pool")
    pool_ops = _ops(monkeypatch, device)
    # the first C++ compile of a build waits (the trace lock let go) until another build's
    # compiler starts too: builds run one after another would never get there, so the wait
    # times out and that build fails, whatever the timing
    build_pool._compiler_hook()
    real_compile, met, first, lock = build_pool._compile, threading.Event(), [], threading.Lock()

    def compile_when_another_compiles(cmd_line, cwd):
        with lock:
            me = threading.current_thread()
            waits = not first
            if waits:
                first.append(me)
            elif me is not first[0]:
                met.set()
        if waits and not met.wait(HANG_S):
            raise RuntimeError("no other build's compiler started while this one waited")
        return real_compile(cmd_line, cwd)

    monkeypatch.setattr(build_pool, "_compile", compile_when_another_compiles)
    with build_pool.together(2) as pool:  # what ForwardRunner's warm-up does
        _hidden(model, counts[0])  # the parts run eager while their graphs build
    assert met.is_set()
    assert not torch.compiler.is_compiling()  # the overlapping builds' sessions left no flag set
    assert pool.submitted == 2 and pool.in_flight_max == 2 and pool.compiling_max == 2
    assert pool.compiler_seconds > 0  # g++'s part of the builds, counted where it ran
    assert _built(pool_ops) == {"attention_inputs": 1, "after_attention": 1}  # as the serial
    assert all(p.build_seconds > 0 for p in (pool_ops._inputs, pool_ops._after))
    for n in counts:
        got = _hidden(model, n)  # the built graphs
        assert torch.equal(got, serial[n])  # the same graphs, bit for bit
        # float32 against float32: fused kernels reorder sums of 64-128 terms (~1e-6 measured)
        assert (got - plain[n]).abs().max().item() < 1e-5
    assert _built(pool_ops) == {"attention_inputs": 1, "after_attention": 1}  # nothing rebuilt


def test_a_failing_build_is_named_and_recorded_while_the_other_builds(cache, monkeypatch, capfd):
    from treeflow.models.compile import precompiled

    real_build, tries = aoti.build, []

    def build(program, *, package, **kwargs):
        if "fails_in_pool" in os.path.basename(package):
            tries.append(package)
            raise RuntimeError("planted build failure")
        real_build(program, package=package, **kwargs)

    monkeypatch.setattr(aoti, "build", build)
    parts = []
    # exact in any implementation, so the built graph equals eager bit for bit
    for name, fn in (("fails_in_pool", torch.abs), ("builds_in_pool", torch.relu)):
        p = precompiled.Precompiled(fn, backend="inductor", name=name, dynamic=(0,),
                                    ahead_of_time=True, eager_while_building=True)
        monkeypatch.setattr(p, "_variant", lambda args, kwargs: None)  # no dynamo capture
        monkeypatch.setattr(p, "fallback", lambda fn=fn: fn)
        parts.append(p)
    x = torch.randn(8, 4)
    with torch.no_grad():
        with build_pool.together(2) as pool:
            assert all(torch.equal(p(x), p.fn(x)) for p in parts)  # eager while building
        assert pool.submitted == 2
        failed, built = parts
        assert (failed.aoti_captured, built.aoti_captured) == (0, 1)
        assert torch.equal(built(x), torch.relu(x))  # the built graph
        assert torch.equal(failed(x), torch.abs(x))  # dynamo's route (here eager)
    assert len(tries) == 2  # in the pool, then alone before it is recorded
    err = capfd.readouterr().err
    assert ("precompiled fails_in_pool: building it beside others failed (RuntimeError: "
            "planted build failure); building it alone") in err
    assert ("precompiled fails_in_pool: compiling it ahead of time failed (RuntimeError: "
            "planted build failure)") in err
    # the build that worked is named only where the pool says its builds finished (the line
    # of the first build handed over names fails_in_pool)
    named = [line for line in err.splitlines() if "builds_in_pool" in line]
    assert len(named) == 1 and named[0].startswith("treeflow: 2 ahead-of-time build(s) "
                                                   "finished"), err
    assert len(glob.glob(os.path.join(cache, "precompiled", "fails_in_pool-*.aoti.failed"))) == 1


def test_the_callers_inductor_config_holds_in_the_pools_threads():
    import torch._inductor.config as inductor_config

    seen = []
    with inductor_config.patch({"aot_inductor.debug_compile": True}):
        with build_pool.together(2) as pool:
            pool.submit("probe", lambda: seen.append(
                (inductor_config.aot_inductor.debug_compile, threading.current_thread().name)),
                lambda error: error)
    assert len(seen) == 1 and seen[0][0] is True
    assert seen[0][1].startswith("treeflow-aoti-build")  # it ran in the pool, not the caller


def test_builds_whose_sessions_end_out_of_order_leave_torchs_compiling_flag_as_found(
        monkeypatch):
    """torch's compile session sets the process-global "compiling" flag and puts back the value it
    found: the first build's session begins (flag found unset), its compiler runs with the trace
    lock let go, the second build's session begins (found set), the first ends (unset), the second
    ends (set, for good). A later eager AdamW step then takes its compiled path: a worker's
    training ran 1e-7 off its child processes' (tests/tq/test_embedded_stream.py's killed
    consumer, after this module's warm-up test in the same worker)."""
    from torch._inductor import cpp_builder

    build_pool._compiler_hook()
    first_compiles, second_compiles, first_done = (threading.Event(), threading.Event(),
                                                   threading.Event())

    def gxx(cmd_line, cwd):  # a build's C++ compiler: the trace lock is let go around it
        if cmd_line == "first":
            first_compiles.set()
            assert second_compiles.wait(HANG_S)
        else:
            second_compiles.set()
            assert first_done.wait(HANG_S)

    def build(name):
        def run():
            if name == "second":  # begins its session while the first one's compiler runs
                with build_pool._released():
                    assert first_compiles.wait(HANG_S)
            with torch.compiler._compile_session_context():
                cpp_builder._run_compile_cmd(name, ".")
            if name == "first":
                first_done.set()
        return run

    monkeypatch.setattr(build_pool, "_compile", gxx)
    errors = []
    assert not torch.compiler.is_compiling()
    with build_pool.together(2) as pool:
        for name in ("first", "second"):
            pool.submit(name, build(name), errors.append)
    assert errors == [None, None] and first_done.is_set()
    assert not torch.compiler.is_compiling()


def test_a_session_of_another_thread_open_when_the_pool_began_is_not_written_back(monkeypatch):
    """Another thread's compile session is open when the warm-up's pool begins (the flag found
    set) and ends, putting back what it found, before the pool closes: the pool must not write
    the flag it found back over that (a warm-up never runs inside a session of its own)."""
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # the other session, open
    with build_pool.together(1):
        torch.compiler._is_compiling_flag = False  # ... and ended, while the pool was open
    assert not torch.compiler.is_compiling()


def test_leaving_together_waits_for_every_build_even_when_the_body_raised():
    done, results = threading.Event(), []
    with pytest.raises(KeyError):
        with build_pool.together(2) as pool:
            pool.submit("slow", lambda: done.wait(HANG_S), lambda error: results.append(error))
            pool.submit("fails", lambda: 1 / 0, lambda error: results.append(error))
            assert build_pool.active() is pool
            done.set()
            raise KeyError("the warm-up failed")
    assert build_pool.active() is None
    assert results[0] is None and isinstance(results[1], ZeroDivisionError)  # submission order


def test_finish_takes_every_build_when_an_owner_fails_and_raises_the_first_from_the_bodys():
    taken = []

    def owner(name):
        def on_done(error):
            taken.append(name)
            if name != "ok":
                raise OSError(f"{name}: disk full")
        return on_done

    with pytest.raises(OSError, match="first: disk full") as raised:
        with build_pool.together(2) as pool:
            for name in ("first", "ok", "second"):
                pool.submit(name, lambda: None, owner(name))
            raise KeyError("the warm-up failed")
    assert taken == ["first", "ok", "second"]  # every owner took its build
    assert isinstance(raised.value.__cause__, KeyError)  # the body's error, kept


def test_a_call_with_no_pool_in_force_waits_for_its_graph_instead_of_running_eager(
        cache, monkeypatch):
    from treeflow.models.compile import precompiled

    p = precompiled.Precompiled(torch.relu, backend="inductor", name="waits", dynamic=(0,),
                                ahead_of_time=True, eager_while_building=True)
    monkeypatch.setattr(p, "_variant", lambda args, kwargs: None)  # no dynamo capture
    x = torch.randn(8, 4)
    with torch.no_grad(), build_pool.together(2):
        assert torch.equal(p(x), torch.relu(x)) and p.aoti_captured == 0  # eager: building
        # a Pending left with no pool in force (a finish cut short): the call waits for it
        monkeypatch.setattr(build_pool, "active", lambda: None)
        assert torch.equal(p(x), torch.relu(x)) and p.aoti_captured == 1


def test_warm_ups_in_two_threads_do_not_share_a_pool():
    inside, leave, seen = threading.Event(), threading.Event(), {}

    def warm_up():
        with build_pool.together(1) as pool:
            seen["own"] = build_pool.active() is pool
            pool.submit("sees", lambda: seen.update(worker=build_pool.active() is pool),
                        lambda error: error)
            inside.set()
            leave.wait(HANG_S)

    t = threading.Thread(target=warm_up)
    t.start()
    try:
        assert inside.wait(HANG_S)
        seen["other"] = build_pool.active()  # this thread is in no together()
    finally:
        leave.set()
        t.join(HANG_S)
    assert seen == {"own": True, "worker": True, "other": None}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_builds_run_on_the_submitting_threads_cuda_device():
    seen = []
    torch.cuda.init()
    before = torch.cuda.current_device()
    torch.cuda.set_device(1)  # a rank whose device is not 0
    try:
        with build_pool.together(2) as pool:
            pool.submit("device", lambda: seen.append(torch.cuda.current_device()),
                        lambda error: error)
    finally:
        torch.cuda.set_device(before)
    assert seen == [1]


def test_a_first_runs_builds_are_said_on_stderr(capsys):
    """A build (a first run with this compile cache: a minute or more on a GPU) is said when it
    starts and when the warm-up has waited for them all; a warm-up that loads every graph says
    nothing."""
    with build_pool.together(2) as pool:
        pool.submit("flex_attention", lambda: None, lambda error: None)
        pool.submit("attention_inputs", lambda: None, lambda error: None)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("treeflow: compiling flex_attention ahead of time")
    assert err[1].startswith("treeflow: 2 ahead-of-time build(s) finished (attention_inputs, "
                             "flex_attention;")
    with build_pool.together(2):
        pass
    assert capsys.readouterr().err == ""


def test_a_build_waiting_for_the_shared_header_lock_lets_the_trace_lock_go(monkeypatch):
    """inductor precompiles its wrapper header under a file lock every build shares, around g++.
    The first build takes it and runs its compiler (trace lock let go); the second, holding the
    trace lock, waits for the file lock; the first's compiler returns and wants the trace lock
    back. Holding it there, the two waited for each other until the file lock's 600 s timeout (a
    4-layer Qwen3-30B-A3B exact layout's first run on an H100, py-spy). The header precompile now
    runs with the trace lock let go (build_pool._header_hook)."""
    from torch._inductor import codecache, cpp_builder

    build_pool._compiler_hook()
    file_lock = threading.Lock()  # the header's file lock
    compiling, second_waits = threading.Event(), threading.Event()

    def gxx(cmd_line, cwd):  # the first build's compiler returns once the second waits
        compiling.set()
        assert second_waits.wait(HANG_S)
        time.sleep(0.2)  # (the second is in file_lock.acquire by now)

    def header(name):  # inductor's _precompile_header, as far as locks go
        with file_lock:
            cpp_builder._run_compile_cmd(name, ".")
        return name

    monkeypatch.setattr(codecache, "_precompile_header", header)
    build_pool._header_hook()
    monkeypatch.setattr(build_pool, "_compile", gxx)

    def build(name):
        def run():
            if name == "second":
                with build_pool._released():
                    assert compiling.wait(HANG_S)
                second_waits.set()
            codecache._precompile_header(name)
        return run

    errors, done = [], threading.Event()

    def warm_up():
        with build_pool.together(2) as pool:
            for name in ("first", "second"):
                pool.submit(name, build(name), errors.append)
        done.set()

    threading.Thread(target=warm_up, daemon=True).start()
    assert done.wait(HANG_S), "the two builds wait on each other"
    assert errors == [None, None]


def test_in_the_warm_ups_first_pass_a_building_graph_answers_with_its_stand_in(
        cache, monkeypatch):
    """jit_watch.compile_ahead(): a part whose graph builds and that may not run eager (flex)
    answers with its stand-in, so the pass goes on; after the pass the call waits for the
    build and runs the graph."""
    pytest.importorskip("triton")
    import concurrent.futures

    from treeflow.models.compile import jit_watch, precompiled

    p = precompiled.Precompiled(torch.relu, backend="inductor", name="stands_in", dynamic=(0,),
                                ahead_of_time=True, stand_in=lambda x: "stand-in")
    future = concurrent.futures.Future()
    pending = build_pool.Pending("stands_in", future, lambda error: lambda a, k: "built")
    monkeypatch.setattr(p, "_graph", lambda args, kwargs: pending)
    x = torch.randn(8, 4)
    # a pass that waited instead would hang: the build ends after 5 s and the pass sees "built"
    timer = threading.Timer(5.0, lambda: future.done() or future.set_result(None))
    timer.start()
    with torch.no_grad(), build_pool.together(2):
        with jit_watch.compile_ahead(1):
            assert jit_watch.ahead()
            assert p(x) == "stand-in"
        assert not jit_watch.ahead()
        timer.cancel()
        if not future.done():
            future.set_result(None)
        assert p(x) == "built"
