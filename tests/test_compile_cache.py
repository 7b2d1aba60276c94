"""--compile-cache: torch.compile's on-disk caches in a directory of the user's own, or off."""

import os
import stat

import pytest
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._inductor.runtime.cache_dir_utils import cache_dir

from treeflow import compile_cache
from treeflow.cli import build_parser
from treeflow.cli.main import _compile_cache

# tests/conftest.py gives every test back the cache, its environment and torch's flags


def _replay_args(*extra):
    return build_parser().parse_args(["replay", "e.arrow", "-o", "lp.arrow", *map(str, extra)])


def test_the_flag_reaches_torch_s_config(tmp_path):
    where = tmp_path / "cache" / "inductor"
    inductor_config.fx_graph_cache = functorch_config.enable_autograd_cache = False
    assert _compile_cache(_replay_args("--compile-cache", where)) == 0
    assert cache_dir() == str(where)  # where inductor writes and looks up compiled graphs
    assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
    assert os.environ["TRITON_CACHE_DIR"] == str(where / "triton")
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o700 and os.stat(where).st_uid == os.getuid()
    # off: both caches off here, and forced off for the ranks a command spawns
    _compile_cache(_replay_args("--compile-cache", "off"))
    assert not inductor_config.fx_graph_cache and not functorch_config.enable_autograd_cache
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"
    assert os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "0"
    # and on again takes back the forcing variables it set
    compile_cache.configure(where)
    assert "TORCHINDUCTOR_FX_GRAPH_CACHE" not in os.environ and inductor_config.fx_graph_cache


def test_the_default_is_under_the_user_s_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert _replay_args().compile_cache is None
    assert compile_cache.configure(None) == str(tmp_path / "xdg" / "treeflow" / "inductor")
    assert cache_dir() == str(tmp_path / "xdg" / "treeflow" / "inductor")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_cache_others_can_write_is_refused_by_name(tmp_path, mode):
    where = tmp_path / "shared"
    where.mkdir()
    os.chmod(where, mode)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with pytest.raises(ValueError, match=f"compile cache {where} is writable by group or others"):
        compile_cache.configure(where)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before  # nothing was pointed at it


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user owns needs root")
def test_a_cache_another_user_owns_is_refused_by_name(tmp_path):
    where = tmp_path / "theirs"
    where.mkdir(mode=0o700)
    os.chown(where, 65534, 65534)
    with pytest.raises(ValueError, match=f"compile cache {where} is owned by uid 65534"):
        compile_cache.configure(where)
    link = tmp_path / "link"  # a link of one's own to it is the same directory
    link.symlink_to(where)
    with pytest.raises(ValueError, match="owned by uid 65534"):
        compile_cache.configure(link)


def test_a_file_is_not_a_cache(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        compile_cache.configure(tmp_path / "f")


_HEADERS_PROBE = """
import os, sys
from treeflow import compile_cache
compile_cache.configure(sys.argv[1])
assert "torch" not in sys.modules  # the CLI configures before torch is imported
import torch
f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="inductor")
f(torch.randn(64))
import torch._inductor.codecache as codecache
print(codecache._HEADER_DIR)
"""


def test_precompiled_headers_go_into_the_cache_not_tmp(tmp_path):
    """torch 2.13 writes the precompiled C++ headers every CPU kernel build includes under
    /tmp/torchinductor_$USER whatever TORCHINDUCTOR_CACHE_DIR says (a name any local user can
    create first and fill): a CLI-configured process, torch imported after, builds a kernel and
    its headers are in the cache. Without the import hook they are in /tmp."""
    import subprocess
    import sys

    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _HEADERS_PROBE, str(cache)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    headers = cache / "precompiled_headers"
    assert out.stdout.split()[-1] == str(headers)
    assert any(p.suffix == ".gch" for p in headers.iterdir()), sorted(headers.iterdir())
    assert stat.S_IMODE(os.stat(headers).st_mode) == 0o700


def test_precompiled_headers_follow_configure_once_torch_is_imported(tmp_path):
    """The library case: codecache imported already; off turns header precompiling off (no
    shared directory is written), on again turns it back on in the new cache."""
    import torch._inductor.codecache as codecache

    compile_cache.configure(str(tmp_path / "a"))
    assert codecache._HEADER_DIR == str(tmp_path / "a" / "precompiled_headers")
    compile_cache.configure("off")
    assert not inductor_config.cpp_cache_precompile_headers
    assert not inductor_config.aot_inductor.precompile_headers
    compile_cache.configure(str(tmp_path / "b"))
    assert inductor_config.cpp_cache_precompile_headers
    assert inductor_config.aot_inductor.precompile_headers
    assert codecache._HEADER_LOCK_DIR == str(tmp_path / "b" / "precompiled_headers" / "locks")


def test_a_move_forgets_the_headers_made_in_the_old_cache(tmp_path):
    """torch memoizes each precompiled header's path: after a move (and under build_pool's hook
    around it) the memo is dropped, so no build includes a header from a deleted cache (CI: a
    test's cache removed at its teardown, the next test's g++ failed on its -include)."""
    import functools
    import types

    made = []

    @functools.cache
    def precompile(header):
        made.append(header)
        return os.path.join(fake._HEADER_DIR, header)

    fake = types.SimpleNamespace(_HEADER_DIR=str(tmp_path / "a"), _precompile_header=precompile)
    (tmp_path / "a").mkdir()
    assert fake._precompile_header("h") == str(tmp_path / "a" / "h")
    compile_cache.headers_to(fake, str(tmp_path / "a"))  # no move: the memo stays
    assert fake._precompile_header("h") == str(tmp_path / "a" / "h") and made == ["h"]
    compile_cache.headers_to(fake, str(tmp_path / "b"))
    assert fake._precompile_header("h") == str(tmp_path / "b" / "h") and made == ["h", "h"]
    assert fake._HEADER_LOCK_DIR == str(tmp_path / "b" / "locks")
    # build_pool's hook wraps the memoized function: the move reaches through the wrapper
    fake._precompile_header = functools.wraps(precompile)(lambda *a: precompile(*a))
    compile_cache.headers_to(fake, str(tmp_path / "c"))
    assert fake._precompile_header("h") == str(tmp_path / "c" / "h") and len(made) == 3
    compile_cache.headers_to(fake, str(tmp_path / "c"))  # the same, but gone: forgotten too
    assert fake._precompile_header("h") == str(tmp_path / "c" / "h") and len(made) == 4
