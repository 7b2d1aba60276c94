"""Test-wide settings: hypothesis is derandomized by default so that CI is deterministic.

Explore new examples locally with `pytest --hypothesis-profile=explore`.

Tests marked `slow` (the 20-trial kill-and-resume loop, the longest multi-process
parametrizations) are skipped unless `--run-slow`, TREEFLOW_SLOW=1 or a `-m`
expression that names `slow` (`-m slow` runs just them) is given: the CI command
`pytest -m "not gpu"` then stays as it is and still runs their short versions,
and nobody has to remember to add `-m "not slow"`.

Tests that need Ray take the session's one cluster (`ray_cluster`): starting
and stopping one costs seconds each, more on a loaded machine. The engines
attach to a cluster that runs (treeflow.pipeline.ray.init_ray,
treeflow.train.launch.ray_ranks), so the tests use it as a user's driver would.

Under pytest-xdist (`-n 2 --dist loadgroup`, README's command) every test that uses Ray (marked
`ray` or taking `ray_cluster`) is in one xdist group, so one worker runs them all on its one
cluster while the others run the rest; each worker's torch uses its share of the cores (the
host's cores over the workers), and so do the processes it starts (OMP_NUM_THREADS). Without
`-n` none of this applies and a run is as it was.
"""

import os
import re
import sys

import pytest
import torch
from hypothesis import settings

# Without CUDA, Triton kernels (models/ssm/triton_scan.py) run in triton's interpreter, which
# triton picks as it decorates a kernel -- its own library's too, at `import triton` -- so it
# is set before anything imports triton (torch.utils._triton.has_triton does). The CLI's
# refusal of --ssm-kernel triton on CPU is tested with it unset (tests/reliability).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray refuses to create an object that must spill, and its raylet prints an error line to every
# driver every 10 s, once the disk holding /tmp/ray is 95% full by its count (statvfs's free
# blocks over all blocks), however many GB are left: a CI host of 252 GB with 6.4 GB free (97%)
# failed the streaming test (OutOfDiskError on a 314 MB file) and the CLI's no-banner test (the
# raylet's line). The host's fill is not under test and no test spills more than a few hundred
# MB: every Ray cluster the tests start -- the session's, and the CLI's in a subprocess, which
# inherits this -- refuses only a disk that is full.
os.environ.setdefault("RAY_local_fs_capacity_threshold", "1.0")

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


_CACHE_HOME = "TREEFLOW_TEST_CACHE_HOME"  # the run's cache home, made by the first process


def _own_cache_home() -> None:
    """The run's $XDG_CACHE_HOME: a temporary directory, made once (xdist workers inherit it),
    so that no test or command it runs writes the user's ~/.cache/treeflow (compile caches, the
    machine's vector-ISA answers) or reads what an earlier run left there."""
    if _CACHE_HOME not in os.environ:
        import tempfile

        os.environ[_CACHE_HOME] = tempfile.mkdtemp(prefix="treeflow-test-cache-")
        os.environ["TREEFLOW_TEST_CACHE_HOME_OWNER"] = str(os.getpid())
    os.environ["XDG_CACHE_HOME"] = os.environ[_CACHE_HOME]


def pytest_unconfigure(config):
    if os.environ.get("TREEFLOW_TEST_CACHE_HOME_OWNER") == str(os.getpid()):
        import shutil

        shutil.rmtree(os.environ.get(_CACHE_HOME, ""), ignore_errors=True)


def pytest_configure(config):
    """The run's own cache home (`_own_cache_home`); an xdist worker takes its share of the
    cores: N workers each at the host's threads would contend (a tiny model's matmuls run many
    times slower over busy threads)."""
    _own_cache_home()
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    if config.getvalue("loadgroup"):
        config.pluginmanager.register(_XdistGroupIds(), "treeflow-xdist-group-ids")
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # the CLI runs and ranks it starts
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _slow_asked(config) -> bool:
    """--run-slow, TREEFLOW_SLOW=1, or a -m expression naming `slow` (then -m alone decides)."""
    if config.getoption("--run-slow") or os.environ.get("TREEFLOW_SLOW", "") not in ("", "0"):
        return True
    return re.search(r"\bslow\b", config.getoption("markexpr") or "") is not None


def _xdist_group(item) -> str | None:
    """The xdist group of a test: "ray" for every test that uses Ray (one worker, one cluster);
    its module's path where the test takes a module- or class-scoped fixture of its module (a
    shared run, a checkpoint, a spawn): without a group xdist hands a module's tests to both
    workers and each builds that fixture again."""
    if item.get_closest_marker("ray") or "ray_cluster" in getattr(item, "fixturenames", ()):
        return "ray"
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        scope = getattr(defs[-1].scope, "value", defs[-1].scope)
        if scope in ("module", "class") and defs[-1].baseid.startswith(module):
            return module
    return None


class _XdistGroupIds:
    """pytest-xdist 3.8 tells its scheduler a test's group by renaming the test `ID@GROUP`, a
    write that pytest 9.2's structured node ids ignore (pytest-xdist issue 1386): every test
    would then go out on its own. Rename the tests where xdist's rename did not take."""

    @pytest.hookimpl(trylast=True)  # after xdist's own rename
    def pytest_collection_modifyitems(self, items):
        for item in items:
            mark = item.get_closest_marker("xdist_group")
            group = mark and (mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            if group and not item.nodeid.endswith(f"@{group}"):
                item._id = type(item._id).parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            group = _xdist_group(item)
            if group is not None and item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(group))
    if _slow_asked(config):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow, --run-slow or TREEFLOW_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _worker_threads() -> int | None:
    """The torch thread count an xdist worker runs at (pytest_configure's OMP_NUM_THREADS, which
    the processes a test starts inherit); None without xdist."""
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT") is None:
        return None
    return int(os.environ.get("OMP_NUM_THREADS", "0")) or None


def _set_threads(n: int | None) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True, scope="module")
def _torch_threads_at_module_start():
    """A module's own module-scoped fixtures (autouse ones run first) compute at the worker's
    thread count, the count the ranks and children they are compared with bit for bit run at."""
    _set_threads(_worker_threads())
    yield
    _set_threads(_worker_threads())


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """In-process commands may set torch's thread count (`rollout --threads` defaults to 1):
    give every later test the count it started with (under xdist: the worker's), as a child
    process would have it."""
    torch = sys.modules.get("torch")
    n = torch.get_num_threads() if torch is not None else None
    yield
    _set_threads(_worker_threads() or n)


_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
              "TORCHINDUCTOR_AUTOGRAD_CACHE", "TRITON_CACHE_DIR")


@pytest.fixture(autouse=True)
def _compile_cache_restored():
    """An in-process command turns the compile cache on (`--compile-cache`, else the user's
    default directory): give every later test the cache it started with, its environment and
    torch's flags. A leaked cache let a later test load graphs a command had saved instead of
    tracing them (the one-graph-per-part count read 0 in CI)."""
    env = {k: os.environ.get(k) for k in _CACHE_ENV}
    cc = sys.modules.get("treeflow.compile_cache")
    was = (cc._active, dict(cc._ours)) if cc is not None else (None, {})
    flags = _torch_cache_flags()
    headers = _torch_headers()
    headers_off = getattr(cc, "_headers_off", False)
    yield
    if headers is not None:  # where torch's precompiled headers go (compile_cache.point_headers)
        codecache, config = (sys.modules["torch._inductor.codecache"],
                             sys.modules["torch._inductor.config"])
        from treeflow.compile_cache import headers_to

        headers_to(codecache, headers[0])  # the memo of headers made elsewhere dropped too
        (codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR, config.cpp_cache_precompile_headers,
         config.aot_inductor.precompile_headers) = headers
        if cc is not None:
            cc._headers_off = headers_off
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    cc = sys.modules.get("treeflow.compile_cache")
    if cc is not None:
        cc._active = was[0]
        cc._ours.clear()
        cc._ours.update(was[1])
    if flags is not None:
        inductor, functorch = (sys.modules.get("torch._inductor.config"),
                               sys.modules.get("torch._functorch.config"))
        inductor.fx_graph_cache, functorch.enable_autograd_cache = flags
    if headers is None and "torch._inductor.codecache" in sys.modules:
        _torch_headers_to_default()  # imported during the test, maybe into its tmp_path


def _torch_headers_to_default():
    """Where torch's import puts its precompiled headers (its cache directory, from the
    environment just restored) and its header flags' defaults: for a test during which torch's
    codecache was first imported, so no header in that test's deleted tmp_path is used later."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from treeflow.compile_cache import headers_to

    codecache, config = (sys.modules["torch._inductor.codecache"],
                         sys.modules["torch._inductor.config"])
    headers_to(codecache, os.path.join(default_cache_dir(), "precompiled_headers"))
    for name in ("cpp_cache_precompile_headers", "aot_inductor.precompile_headers"):
        entry = config._config[name]
        section, _, flag = name.rpartition(".")
        setattr(getattr(config, section) if section else config, flag, entry.default)
    cc = sys.modules.get("treeflow.compile_cache")
    if cc is not None:
        cc._headers_off = False


def _torch_headers():
    codecache, config = (sys.modules.get("torch._inductor.codecache"),
                         sys.modules.get("torch._inductor.config"))
    if codecache is None or config is None:
        return None
    return (codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR,
            config.cpp_cache_precompile_headers, config.aot_inductor.precompile_headers)


def _torch_cache_flags():
    inductor, functorch = (sys.modules.get("torch._inductor.config"),
                           sys.modules.get("torch._functorch.config"))
    if inductor is None or functorch is None:
        return None
    return inductor.fx_graph_cache, functorch.enable_autograd_cache


def _leaked_default_group() -> bool:
    """Whether a torch.distributed default process group is initialised in this process (read
    only where torch.distributed was imported: asking costs nothing then)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _release_default_group() -> None:
    """Tear down megatron-core's parallel state and the default group, so later tests in this
    worker start clean even after a leak was reported."""
    mcore = sys.modules.get("megatron.core.parallel_state")
    if mcore is not None and mcore.model_parallel_is_initialized():
        mcore.destroy_model_parallel()
    if _leaked_default_group():
        sys.modules["torch.distributed"].destroy_process_group()


def _fail_on_leaked_group(what: str, was: bool) -> None:
    if not was and _leaked_default_group():
        _release_default_group()
        pytest.fail(f"{what} left a torch.distributed default process group initialised in "
                    "this process: a later test in the same xdist worker would see "
                    "dist.is_initialized() True. Destroy it where it is made (the megatron "
                    "backend's one-process group: tests/conftest.py's `megatron_group` or "
                    "`megatron_module_group` fixture), or run the ranks in child processes.",
                    pytrace=False)


@pytest.fixture(scope="session")
def shared_headers(tmp_path_factory):
    """One directory of inductor's precompiled headers for the ahead-of-time C++ builds of a
    test process (tests/test_compile_cache_precompiled.py's `with_headers` links it into a new
    cache): two g++ runs (~13 s of CPU) that every new cache directory would pay again in its
    first build, the same .gch files each time (their names hash the compile command and the
    preprocessed header, not the directory). Tests that check where headers go or that they are
    made (tests/test_compile_cache.py) use caches of their own."""
    return tmp_path_factory.mktemp("precompiled_headers")


@pytest.fixture
def megatron_group():
    """For a test that loads the megatron backend in this process: the one-process group and
    megatron-core's parallel state that models/megatron/parallel.py makes (and keeps for the
    process, as MCore's state is per process) are torn down after the test, if it made them."""
    was = _leaked_default_group()
    yield
    if not was:
        _release_default_group()


@pytest.fixture(scope="module")
def megatron_module_group():
    """`megatron_group` for a module-scoped fixture that holds a megatron backend: torn down
    after the module (a fixture that loads the backend takes this one as an argument)."""
    was = _leaked_default_group()
    yield
    if not was:
        _release_default_group()


def _left_behind_guard(scope: str, state, fail, doc: str):
    """An autouse fixture of `scope` ("module": its module-scoped fixtures included, or
    "function") that reads `state()` before and calls `fail(what, before)` after."""
    def guard(request):
        before = state()
        yield
        fail(f"{'module' if scope == 'module' else 'test'} {request.node.nodeid}", before)

    guard.__doc__ = doc
    return pytest.fixture(autouse=True, scope=scope)(guard)


_no_process_group_left_by_module = _left_behind_guard(
    "module", _leaked_default_group, _fail_on_leaked_group,
    "A module (its module-scoped fixtures included) leaves no default process group.")
_no_process_group_left_by_test = _left_behind_guard(
    "function", _leaked_default_group, _fail_on_leaked_group,
    "A test leaves no default process group behind (one an xdist worker's later tests see).")


# torch.compiler's process-global flags (torch.compiler.is_compiling()): each export and compile
# session sets them and puts back what it found, so sessions that end out of order in two threads
# leave them set (treeflow/models/compile/build_pool.py's docstring)
_COMPILER_FLAGS = ("_is_compiling_flag", "_is_exporting_flag", "_is_non_strict_tracing_flag")


def _compiler_flags() -> dict:
    compiler = sys.modules.get("torch.compiler")
    return {n: getattr(compiler, n) for n in _COMPILER_FLAGS if hasattr(compiler, n)}


def _fail_on_compiler_flags(what: str, before: dict) -> None:
    changed = {n: (before.get(n), v) for n, v in _compiler_flags().items() if v != before.get(n)}
    if not changed:
        return
    for name, (was, _) in changed.items():  # later tests start clean even after a report
        setattr(sys.modules["torch.compiler"], name, was)
    said = ", ".join(f"{n} {a} -> {b}" for n, (a, b) in changed.items())
    pytest.fail(f"{what} left torch.compiler's flags set outside any compile ({said}): every "
                "later eager AdamW step of this process takes its compiled path (bias "
                "corrections in float32 tensors), so a later test that compares training here "
                "with a child process's or ranks' bit for bit fails at rounding level. Put them "
                "back where the overlapping export or compile sessions run (as "
                "treeflow/models/compile/build_pool.py's together() does for its builds).",
                pytrace=False)


_no_compiler_flag_left_by_module = _left_behind_guard(
    "module", _compiler_flags, _fail_on_compiler_flags,
    "A module (its module-scoped fixtures included) leaves torch.compiler's flags as it found them.")
_no_compiler_flag_left_by_test = _left_behind_guard(
    "function", _compiler_flags, _fail_on_compiler_flags,
    "A test leaves torch.compiler's flags as it found them (is_compiling() False after it).")


RAY_CPUS = 4  # TransferQueue's controller and storage unit reserve one logical CPU each
RAY_OBJECT_STORE = 100 * 2**20  # small, so that a streaming test can outgrow it


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster, started here (its address is ours whatever else runs here).

    A test must leave it running: no ray.shutdown(), and actors it starts are killed by it or
    by the engine it runs.
    """
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    import torch

    # the host's GPUs too, so the GPU tests' actors (tests/gpu) run on this cluster as well
    ray.init(num_cpus=RAY_CPUS, num_gpus=torch.cuda.device_count(),
             object_store_memory=RAY_OBJECT_STORE, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False)
    yield ray
    if "transfer_queue" in sys.modules:
        sys.modules["transfer_queue"].close()
    ray.shutdown()
