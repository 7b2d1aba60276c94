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


def require(module: str, *, extra: str = "dev"):
    """Import `module`; skip the calling test module without it, except in CI, where it fails."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        fix = f'pip install -e ".[{extra}]"'
        if in_ci():
            raise ImportError(f"{module} is a test dependency and must be installed in CI "
                              f"(CI={os.environ['CI']!r}): {fix}") from e
        pytest.skip(f"{module} is not installed; {fix}", allow_module_level=True)
