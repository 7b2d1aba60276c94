"""Test dependencies that must never skip silently in CI.

`transformers` is in the `dev` extra because the Hugging Face comparison tests
are the independent reference for checkpoints and logprobs. Locally a missing
package skips those tests (with the install command); in CI (`CI` set, as CI
services do) it is an error, so a broken install cannot turn them into skips.
"""

from __future__ import annotations

import importlib
import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require(module: str, *, extra: str = "dev", min_version: str | None = None, why: str = ""):
    """Import `module`; skip the calling test module without it (or, with `min_version`, with an
    older release: `why` says what the tests need of the newer one), except in CI, where it fails."""
    fix = f'pip install -e ".[{extra}]"'
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        if in_ci():
            raise ImportError(f"{module} is a test dependency and must be installed in CI "
                              f"(CI={os.environ['CI']!r}): {fix}") from e
        pytest.skip(f"{module} is not installed; {fix}", allow_module_level=True)
    have = getattr(mod, "__version__", "0")
    if min_version is not None and _release(have) < _release(min_version):
        msg = f"needs {module} >= {min_version} ({why}); found {have}: {fix}"
        if in_ci():
            raise ImportError(msg)
        pytest.skip(msg, allow_module_level=True)
    return mod


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "5.17.0" -> (5, 17, 0); "5.25.0.dev0" -> (5, 25, 0)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)
