"""Process-global state no test may leave changed: what a later test of the same worker would see.

CI runs `pytest -n 2 --dist loadgroup`, so which tests share a process changes from machine to
machine, and a global that one test leaves changed fails another test somewhere else (the
compile cache an in-process command left on made a later test load graphs instead of tracing
them). `tests/conftest.py` takes a `snapshot()` before every test and `check()`s it after.

Two kinds of state. What an in-process command sets for its whole process on purpose (the CLI's
library-quieting environment, its warning format, treeflow's warn-once caches) is restored
silently, as a child process would have left it (`RESTORED`). Anything else that changed fails
the test that changed it, names the state and where to fix it, and is put back so that later
tests still start clean. Random seeds are not checked: tests seed what they draw.

The trade-off is cost against reach: the fingerprint is cheap reads only (a copy of
os.environ, a few flags, identities of hooks and handlers, torch's compile configs' user
overrides, the levels of the loggers that existed before), tens of microseconds to a
millisecond per test, and it does not walk objects (threads, child processes other than the
tensor queue's servers, dynamo's graph caches are not checked).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading

# what the CLI's main() sets for its process (cli/trackers.py quiet_libraries): a test that runs
# it in-process gets the values back as a child process would have left them
RESTORED_ENV = ("RAY_LOGGER_LEVEL", "RAY_DATA_DISABLE_PROGRESS_BARS", "RAY_DEDUP_LOGS",
                "TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS",
                "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE", "TREEFLOW_QUIET_LIBRARIES",
                # the compile cache's (treeflow/compile_cache.py; conftest's
                # `_compile_cache_restored`), which inductor also sets to its default the
                # first time it asks for its cache directory
                "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
                "TORCHINDUCTOR_AUTOGRAD_CACHE", "TRITON_CACHE_DIR")
# what a library sets once, as it is first imported or started (polars: its allocator's
# settings; ray.init: its debugger), and the sys.path entries a library adds inside its own
# install (`import ray`: its vendored packages, which it imports from later): neither put back
# nor a leak (the import is not undone; a process that imports it again sets them again)
IMPORT_ENV = ("_RJEM_MALLOC_CONF", "PYTHONBREAKPOINT")
_LIBRARY_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
RESTORED = ("the environment keys of RESTORED_ENV", "warnings.formatwarning (the CLI's format)",
            "treeflow's warn-once caches (functools.cache'd `_warn*` / `*_once` functions)")
SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2",
                                             "SIGCHLD", "SIGPIPE", "SIGALRM")
                if hasattr(signal, s))
_COMPILE_CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
# handlers not compared: pytest's (it adds and removes them around each phase) and torch's
# structured-trace handler (it removes itself from `torch.__trace` on its first record, a
# one-time step like an import's)
_PYTEST_HANDLERS = ("LogCaptureHandler", "_LiveLoggingNullHandler", "_FileHandler",
                    "_LiveLoggingStreamHandler", "LazyTraceHandler")


class Leak(Exception):
    """One piece of state a test left changed: what, before -> after, and where to fix it."""


def _torch_flags():
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return {"torch.get_default_dtype()": torch.get_default_dtype(),
            "torch.is_grad_enabled()": torch.is_grad_enabled(),
            "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
            "torch.are_deterministic_algorithms_enabled()":
                torch.are_deterministic_algorithms_enabled(),
            "torch.is_deterministic_algorithms_warn_only_enabled()":
                torch.is_deterministic_algorithms_warn_only_enabled(),
            "torch.is_anomaly_enabled()": torch.is_anomaly_enabled(),
            "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
            "torch.backends.cudnn.benchmark": torch.backends.cudnn.benchmark,
            "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
            "torch function mode stack depth": torch._C._len_torch_function_stack(),
            "torch dispatch mode stack depth": torch._C._len_torch_dispatch_stack()}


def _set_torch_flag(name: str, value) -> None:
    torch = sys.modules["torch"]
    if name == "torch.get_default_dtype()":
        torch.set_default_dtype(value)
    elif name == "torch.is_grad_enabled()":
        torch.set_grad_enabled(value)
    elif name in ("torch.are_deterministic_algorithms_enabled()",
                  "torch.is_deterministic_algorithms_warn_only_enabled()"):
        torch.use_deterministic_algorithms(
            torch.are_deterministic_algorithms_enabled() if "warn" in name else value,
            warn_only=value if "warn" in name else
            torch.is_deterministic_algorithms_warn_only_enabled())
    elif name == "torch.is_anomaly_enabled()":
        torch.set_anomaly_enabled(value)
    elif name == "torch.get_float32_matmul_precision()":
        torch.set_float32_matmul_precision(value)
    elif name.startswith("torch.backends.cudnn."):
        setattr(torch.backends.cudnn, name.rsplit(".", 1)[1], value)
    # inference mode and the mode stacks are context managers left open: nothing to set back


def _overrides(module) -> dict:
    """A torch config module's user overrides that differ from the defaults (reading a list
    default makes a copy into the override: equal values are no change)."""
    from torch.utils._config_module import _UNSET_SENTINEL

    out = {}
    for key, entry in module._config.items():
        value = entry.user_override.get()
        if value is _UNSET_SENTINEL:
            continue
        try:
            same = bool(value == entry.default)
        except Exception:  # noqa: BLE001 - an object without a usable ==: compared by identity
            same = value is entry.default
        if not same:
            out[key] = value
    return out


# torch's own scratch in its config: AOTInductor writes each build's device facts into it
_TORCH_SCRATCH = {"torch._inductor.config": ("aot_inductor.metadata",)}


def _compile_configs() -> dict:
    out = {name: _overrides(sys.modules[name]) for name in _COMPILE_CONFIGS
           if name in sys.modules}
    for name, keys in _TORCH_SCRATCH.items():
        for key in keys:
            out.get(name, {}).pop(key, None)
    return out


def _loggers() -> dict:
    """(level, disabled, propagate, handlers) of every logger made so far (the handlers of
    _PYTEST_HANDLERS left out)."""
    manager = logging.Logger.manager
    out = {}
    for name, logger in [("", logging.getLogger())] + list(manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            handlers = tuple(h for h in logger.handlers
                             if type(h).__name__ not in _PYTEST_HANDLERS)
            out[name] = (logger.level, logger.disabled, logger.propagate, handlers)
    return out


def _once_caches() -> list:
    """treeflow's warn-once functions (functools.cache'd, named `_warn*` or `*_once`)."""
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("treeflow") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if (isinstance(value, functools._lru_cache_wrapper)
                    and getattr(value, "__module__", None) == name
                    and (attr.startswith("_warn") or attr.endswith("_once"))):
                found.append(value)
    return found


@functools.cache
def _once_caches_of(n_modules: int) -> tuple:
    return tuple(_once_caches())


def _hooks() -> dict:
    import faulthandler
    import multiprocessing

    return {"sys.excepthook": sys.excepthook, "threading.excepthook": threading.excepthook,
            "sys.unraisablehook": sys.unraisablehook,
            "faulthandler.is_enabled()": faulthandler.is_enabled(),
            # unset reads as the platform's default (asking for it sets it, to the same)
            "multiprocessing start method": (multiprocessing.get_start_method(allow_none=True)
                                             or multiprocessing.get_all_start_methods()[0]),
            "sys.getrecursionlimit()": sys.getrecursionlimit()}


def _raised_recursion_limit(hooks: dict) -> dict:
    """A raised recursion limit is no leak (inductor's compile raises it to 2000 and keeps it:
    torch/_inductor/compile_fx.py); a lowered one is."""
    was, now = hooks.get("sys.getrecursionlimit()", (0, 0))
    return {k: v for k, v in hooks.items() if k != "sys.getrecursionlimit()" or now < was}


def _treeflow_globals() -> dict:
    out = {}
    lock = sys.modules.get("treeflow.lock")
    if lock is not None:
        out["treeflow.lock._held"] = tuple(lock._held)
    embedded = sys.modules.get("treeflow.tq.embedded")
    if embedded is not None:
        out["treeflow.tq.embedded._LIFELINES"] = tuple(embedded._LIFELINES)
    ray = sys.modules.get("ray")
    if ray is not None and hasattr(ray, "is_initialized"):
        out["ray.is_initialized()"] = ray.is_initialized()
    return out


def snapshot() -> dict:
    """The fingerprint of the process-global state, taken before a test."""
    import warnings

    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)  # pytest's own, a new value each phase
    return {"env": env, "sys.path": list(sys.path), "cwd": os.getcwd(),
            "torch": _torch_flags(), "configs": _compile_configs(), "loggers": _loggers(),
            "signals": {s: signal.getsignal(s) for s in SIGNALS}, "hooks": _hooks(),
            "formatwarning": warnings.formatwarning, "treeflow": _treeflow_globals()}


def _changed(before: dict, after: dict) -> dict:
    pairs = {k: (before.get(k, "<unset>"), after.get(k, "<unset>")) for k in {*before, *after}}
    return {k: (a, b) for k, (a, b) in pairs.items() if a != b}


def check(before: dict, *, module: bool = False) -> list[str]:
    """Put back what changed since `before`; the leaks (messages naming state and fix) among it.

    `module`: `before` was taken as a module started, and session fixtures (the Ray cluster)
    may have started since: what they set (RAY_ variables, loggers, signal handlers, hooks,
    Ray itself) is not compared."""
    import warnings

    leaks = []
    warnings.formatwarning = before["formatwarning"]
    for cache in _once_caches_of(len(sys.modules)):
        cache.cache_clear()

    now = dict(os.environ)
    now.pop("PYTEST_CURRENT_TEST", None)
    env = {k: v for k, v in _changed(before["env"], now).items() if k not in IMPORT_ENV}
    for key, (was, _) in env.items():
        if was == "<unset>":
            os.environ.pop(key, None)
        else:
            os.environ[key] = was
    env = {k: v for k, v in env.items()
           if k not in RESTORED_ENV and not (module and k.startswith("RAY_"))}
    if env:
        leaks.append(f"os.environ {_show(env)}: set it with monkeypatch.setenv, or restore it "
                     "where the code sets it (a command's child processes inherit a value "
                     "passed as their env, not this process's)")
    if list(sys.path) != before["sys.path"]:
        ours = [p for p in sys.path
                if p in before["sys.path"] or not any(d in p for d in _LIBRARY_DIRS)]
        if ours != before["sys.path"]:
            added = [p for p in ours if p not in before["sys.path"]]
            sys.path[:] = [p for p in sys.path if p not in added]
            if [p for p in sys.path if p in before["sys.path"]] != before["sys.path"]:
                sys.path[:] = before["sys.path"]  # reordered or removed: the whole list back
            leaks.append(f"sys.path (added {added}, was {len(before['sys.path'])} entries): "
                         "use monkeypatch.syspath_prepend")
    if os.getcwd() != before["cwd"]:
        now = os.getcwd()
        os.chdir(before["cwd"])
        leaks.append(f"cwd {before['cwd']} -> {now}: use monkeypatch.chdir")
    leaks += _check_torch(before)
    if module:
        return leaks + _check_treeflow(before["treeflow"], ray=False)
    leaks += _check_loggers(before["loggers"])
    signals = _changed(before["signals"], {s: signal.getsignal(s) for s in SIGNALS})
    for s, (was, _) in signals.items():
        if was is not None:
            signal.signal(s, was)
    if signals:
        named = {signal.Signals(s).name: v for s, v in signals.items()}
        leaks.append(f"signal handlers {_show(named)}: give the handler back where it is "
                     "installed (treeflow.sigterm.keep_sigterm, treeflow._errors.run)")
    hooks = _raised_recursion_limit(_changed(before["hooks"], _hooks()))
    if hooks:
        _restore_hooks(hooks)
        leaks.append(f"{_show(hooks)}: restore it where it is set (or monkeypatch.setattr)")
    leaks += _check_treeflow(before["treeflow"])
    return leaks


def _check_torch(before: dict) -> list[str]:
    leaks = []
    flags = _changed(before["torch"] or {}, _torch_flags() or {}) if before["torch"] else {}
    for name, (was, _) in flags.items():
        _set_torch_flag(name, was)
    if flags:
        leaks.append(f"{_show(flags)}: set it inside a `with` (torch.no_grad, "
                     "torch.autocast ...) or a fixture that sets it back")
    after = _compile_configs()
    for name in set(before["configs"]) & set(after):
        changed = _changed(before["configs"][name], after[name])
        if not changed:
            continue
        module = sys.modules[name]
        for key, (was, _) in changed.items():
            if was == "<unset>":
                from torch.utils._config_module import _UNSET_SENTINEL

                module._config[key].user_override.set(_UNSET_SENTINEL)
            else:
                setattr(module, key, was)
        leaks.append(f"{name} {_show(changed)}: set it with `{name}.patch(...)` (a context "
                     "manager or decorator that puts it back)")
    return leaks


def _check_loggers(before: dict) -> list[str]:
    after = _loggers()
    changed = {name: (was, after[name]) for name, was in before.items()
               if name in after and after[name] != was}
    fresh = (logging.NOTSET, False, True, ())  # a logger a library's import made is its own
    changed.update({name: (fresh, now) for name, now in after.items()
                    if name not in before and name.split(".")[0] in ("treeflow", "tests")
                    and now != fresh})
    for name, ((level, disabled, propagate, handlers), _) in changed.items():
        logger = logging.getLogger(name or None)
        logger.setLevel(level)
        logger.disabled, logger.propagate = disabled, propagate
        logger.handlers = [h for h in logger.handlers if type(h).__name__ in _PYTEST_HANDLERS]
        logger.handlers += list(handlers)
    if not changed:
        return []
    return [f"logging {_show({n or '<root>': v for n, v in changed.items()})} (level, disabled, "
            "propagate, handlers): set levels with caplog.set_level, remove handlers the code "
            "adds where it adds them"]


def _restore_hooks(hooks: dict) -> None:
    import faulthandler
    import multiprocessing

    for name, (was, _) in hooks.items():
        if name == "sys.excepthook":
            sys.excepthook = was
        elif name == "threading.excepthook":
            threading.excepthook = was
        elif name == "sys.unraisablehook":
            sys.unraisablehook = was
        elif name == "faulthandler.is_enabled()":
            faulthandler.enable() if was else faulthandler.disable()
        elif name == "multiprocessing start method":
            multiprocessing.set_start_method(was, force=True)
        elif name == "sys.getrecursionlimit()":
            sys.setrecursionlimit(was)


def _check_treeflow(before: dict, *, ray: bool = True) -> list[str]:
    after, leaks = _treeflow_globals(), []
    held = set(after.get("treeflow.lock._held", ())) - set(before.get("treeflow.lock._held", ()))
    if held:
        sys.modules["treeflow.lock"].release_all()
        leaks.append(f"treeflow.lock._held still holds {sorted(held)}: release the output locks "
                     "the code claims (treeflow.lock.release / release_all, as _errors.run does)")
    lines = (set(after.get("treeflow.tq.embedded._LIFELINES", ()))
             - set(before.get("treeflow.tq.embedded._LIFELINES", ())))
    if lines:
        lifelines = sys.modules["treeflow.tq.embedded"]._LIFELINES
        for pid in lines:
            lifelines.pop(pid).close()  # the server exits when its lifeline closes
        leaks.append(f"tensor queue server(s) {sorted(lines)} still running "
                     "(treeflow.tq.embedded._LIFELINES): stop() the queue the test started")
    was, now = (before.get("ray.is_initialized()"), after.get("ray.is_initialized()"))
    if ray and (was is not None and now is not None and was != now or was is None and now):
        leaks.append(f"ray.is_initialized() {was} -> {now}: take the session's cluster "
                     "(the `ray_cluster` fixture) and leave it running")
    return leaks


def _show(changed: dict) -> str:
    parts = [f"{k}: {_short(a)} -> {_short(b)}" for k, (a, b) in sorted(changed.items(),
                                                                       key=lambda kv: str(kv[0]))]
    return "{" + "; ".join(parts) + "}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
