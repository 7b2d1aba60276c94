"""Where torch.compile keeps what it compiled between runs, so a second run does not pay again.

torch's inductor caches compiled graphs (the FX graph cache) and AOTAutograd's
forward/backward split (the autograd cache) on disk, keyed by graph, shapes,
device and torch version; a process that compiles the same graphs again loads
them instead of generating and building kernels. By default torch puts that
cache in `/tmp/torchinductor_$USER`, a name in a directory every user can write,
so another user can create it first and fill it with code this user's
processes then run. treeflow points it (`TORCHINDUCTOR_CACHE_DIR`, and Triton's
kernel cache under it when `TRITON_CACHE_DIR` is unset) at a directory in the
user's own cache home, `$XDG_CACHE_HOME/treeflow/inductor` (else
`~/.cache/treeflow/inductor`), created mode 0700, and refuses one that someone
else owns or that group or others can write, naming it. `--compile-cache DIR`
moves it, `--compile-cache off` turns both caches off (every run compiles from
scratch). The setting goes into the environment before torch is imported, so
rank processes the command spawns inherit it, and into torch's config when
torch is already imported (the library case).

Trade-off: the cache grows with every new shape, dtype, torch version and GPU
(tens to hundreds of MB); nothing here prunes it -- delete the directory to
reclaim it. Dynamo's tracing of the Python code is not in torch's caches; the
compiled layer graphs are therefore also saved whole, dynamo's output included,
in `precompiled/` under the directory (models/compile/precompiled.py), which
`active_dir` checks again before every load and `open_own` checks file by file;
FlexAttention's call (block mask built inside it) is saved there the same way.

torch's precompiled C++ headers (`.gch` files every CPU kernel and AOTInductor wrapper build
includes) ignore `TORCHINDUCTOR_CACHE_DIR`: torch 2.13 puts them in
`/tmp/torchinductor_$USER/precompiled_headers`, fixed when `torch._inductor.codecache` is
imported. `configure` moves them into `precompiled_headers/` of the cache (or turns header
precompiling off with the cache): at once when that module is imported already, else through a
one-shot import hook that runs when it is (importing it here would cost a second at startup).
"""

from __future__ import annotations

import importlib.abc
import os
import stat
import sys

__all__ = ["OFF", "active_dir", "add_option", "configure", "default_dir", "home_dir", "is_off",
           "open_own"]

OFF = "off"
_ENV_DIR = "TORCHINDUCTOR_CACHE_DIR"
_ENV_FX = "TORCHINDUCTOR_FX_GRAPH_CACHE"
_ENV_AUTOGRAD = "TORCHINDUCTOR_AUTOGRAD_CACHE"
_ENV_TRITON = "TRITON_CACHE_DIR"
_CODECACHE = "torch._inductor.codecache"
_HEADERS = "precompiled_headers"


def add_option(parser) -> None:
    """`--compile-cache DIR|off` on a command that compiles (treeflow.cli.main applies it)."""
    parser.add_argument("--compile-cache", default=None, metavar="DIR|off",
                        help="directory of torch.compile's on-disk caches (FX graphs, "
                             "AOTAutograd), so a second run loads what the first compiled; "
                             "created mode 0700, refused if others can write it; 'off' compiles "
                             "from scratch (default: $TORCHINDUCTOR_CACHE_DIR, else "
                             # "%(default).0s" prints nothing and stops --help's formatter
                             # from adding "(default: None)"
                             "$XDG_CACHE_HOME/treeflow/inductor)%(default).0s")


def default_dir() -> str:
    """`$XDG_CACHE_HOME/treeflow/inductor`, else `~/.cache/treeflow/inductor`."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "treeflow", "inductor")


def home_dir() -> str:
    """treeflow's cache home, `default_dir()`'s parent: records that belong to the machine, not
    to one compile cache (models/compile/vec_isa.py); made mode 0700 and checked as a cache is.
    Raises ValueError (not the user's own, naming XDG_CACHE_HOME) or OSError (cannot be made)."""
    return _own_dir(os.path.dirname(default_dir()), what="treeflow cache home",
                    fix="point XDG_CACHE_HOME at a directory of your own (it holds the CPU "
                        "vector-ISA record cpu_vec_isa.json)")


def is_off() -> bool:
    """Whether `configure("off")` (`--compile-cache off`) is in force: nothing is recorded."""
    return _off


def configure(where: str | os.PathLike | None = None) -> str | None:
    """Turn torch's compile caches on in `where` (None: $TORCHINDUCTOR_CACHE_DIR if set, else
    `default_dir()`), or off with "off"; the directory used, or None when off.

    Raises ValueError naming the directory when it is not the caller's own: owned by another
    user, writable by group or others, or not a directory.
    """
    global _active, _off
    if where is not None and os.fspath(where) == OFF:
        _set(fx=False, directory=None)
        _active, _off = None, True
        _headers_on_import()
        return None
    if where is None:
        where = os.environ.get(_ENV_DIR) or default_dir()
    directory = _own_dir(os.path.abspath(os.path.expanduser(os.fspath(where))))
    _set(fx=True, directory=directory)
    _active, _off = directory, False
    _headers_on_import()
    return directory


_active: str | None = None  # the directory configure() last turned on; None: off or never called
_off = False  # configure("off") was the last call


def active_dir(sub: str) -> str | None:
    """`sub` inside the directory `configure` turned on, checked again (it may have changed
    since) and made mode 0700 if absent; None when the cache is off or was never configured."""
    if _active is None:
        return None
    _own_dir(_active)
    return _own_dir(os.path.join(_active, sub))


def open_own(path: str):
    """`path` open for reading (binary) if it is a regular file of this user's that group and
    others cannot write, checked on the open file itself; raises ValueError naming it if not."""
    f = open(path, "rb")
    st = os.fstat(f.fileno())
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif hasattr(os, "getuid") and st.st_uid != os.getuid():
        why = f"is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if why is not None:
        f.close()
        raise ValueError(f"compile cache file {path} {why}: it holds code this process would "
                         "run; delete it, or give --compile-cache a directory of your own (or off)")
    return f


def _own_dir(path: str, *, what: str = "compile cache",
             fix: str = "give --compile-cache a directory of your own (or off)") -> str:
    """`path` made if absent (mode 0700) and checked to be this user's alone; its real path.
    `what` names it and `fix` is the way out in the ValueError."""
    _check_parents(os.path.realpath(path), what, fix)
    if not os.path.lexists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made meanwhile by another process: checked below
            pass
    real = os.path.realpath(path)
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what} {path} is not a directory; {fix}")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise ValueError(f"{what} {real} is owned by uid {st.st_uid}, not by you (uid "
                         f"{os.getuid()}): a compile cache holds code this process runs; {fix}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{what} {real} is writable by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):o}): a compile cache holds code this "
                         f"process runs; chmod 700 it, or {fix}")
    return real


def _check_parents(real: str, what: str, fix: str) -> None:
    """Every directory above the cache is root's or this user's, and not writable by group or
    others unless sticky (/tmp): whoever can write a parent can rename the cache away and put
    a directory of their own code in its place."""
    if not hasattr(os, "getuid"):
        return
    parent = os.path.dirname(real)
    while not os.path.exists(parent):  # made below (os.makedirs): checked from what exists
        parent = os.path.dirname(parent)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, os.getuid()):
            raise ValueError(f"{what} {real}: its parent {parent} is owned by uid "
                             f"{st.st_uid}, who could replace the cache with code this process "
                             f"runs; {fix}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise ValueError(f"{what} {real}: its parent {parent} is writable by group or "
                             f"others (mode {stat.S_IMODE(st.st_mode):o}, not sticky), who could "
                             f"replace the cache with code this process runs; chmod go-w "
                             f"{parent}, or {fix}")
        if parent == os.path.dirname(parent):
            return
        parent = os.path.dirname(parent)


_ours: dict[str, str] = {}  # environment variables this module set, and to what


def _set(*, fx: bool, directory: str | None) -> None:
    """The environment for torch not yet imported (and spawned ranks); torch's config if it is.

    "off" uses torch's forcing variables (they win over any later setting, in this process and
    its children); "on" only names the directory (both caches are on by default) and takes
    back a forcing "off" this module set before.
    """
    if fx:
        for name in (_ENV_FX, _ENV_AUTOGRAD):
            if name in _ours and os.environ.get(name) == _ours.pop(name):
                del os.environ[name]
        os.environ[_ENV_DIR] = _ours[_ENV_DIR] = directory
        triton = os.path.join(directory, "triton")
        if os.environ.get(_ENV_TRITON) in (None, _ours.get(_ENV_TRITON)):
            os.environ[_ENV_TRITON] = _ours[_ENV_TRITON] = triton
    else:
        for name in (_ENV_FX, _ENV_AUTOGRAD):
            os.environ[name] = _ours[name] = "0"
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.fx_graph_cache = fx
    functorch = sys.modules.get("torch._functorch.config")
    if functorch is not None:
        functorch.enable_autograd_cache = fx


def point_headers(codecache) -> None:
    """torch's precompiled headers into the active cache's `precompiled_headers/`, or header
    precompiling off when the cache is off; untouched if `configure` was never called."""
    global _headers_off
    config = sys.modules["torch._inductor.config"]
    if _off:
        config.cpp_cache_precompile_headers = config.aot_inductor.precompile_headers = False
        _headers_off = True
        return
    if _headers_off:  # turned off by an earlier configure("off"): on again with the cache
        config.cpp_cache_precompile_headers = config.aot_inductor.precompile_headers = True
        _headers_off = False
    directory = active_dir(_HEADERS)
    if directory is not None:
        headers_to(codecache, directory)


def headers_to(codecache, directory: str) -> None:
    """torch's precompiled headers into `directory`, forgetting the headers it made elsewhere:
    torch memoizes each header's path (`_precompile_header` is a functools.cache), so a build
    after a move would still include the old directory's header, and fail once that directory
    is gone (a command's cache deleted, in one process that goes on)."""
    if getattr(codecache, "_HEADER_DIR", None) != directory or not os.path.isdir(directory):
        fn = getattr(codecache, "_precompile_header", None)  # absent from older torch
        while fn is not None and not hasattr(fn, "cache_clear"):  # under build_pool's hook
            fn = getattr(fn, "__wrapped__", None)
        if fn is not None:
            fn.cache_clear()
    codecache._HEADER_DIR = directory
    codecache._HEADER_LOCK_DIR = os.path.join(directory, "locks")


_headers_off = False  # point_headers turned torch's header precompiling off (configure("off"))


def _headers_on_import() -> None:
    codecache = sys.modules.get(_CODECACHE)
    if codecache is not None:
        point_headers(codecache)
    elif not any(isinstance(f, _OnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport())


class _OnImport(importlib.abc.MetaPathFinder):
    """Finds torch._inductor.codecache as the other finders do, and has its loader call
    `point_headers` once the module has run; then leaves sys.meta_path."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _CODECACHE:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                spec.loader = _ThenPoint(spec.loader)
                return spec
        return None


class _ThenPoint(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        point_headers(module)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self._loader, name)
