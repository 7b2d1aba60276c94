"""The CPU shims megatron-core needs, in one place, applied only when the backend runs on CPU.

(filled in below as needed)
"""

from __future__ import annotations

__all__ = ["apply"]


def apply() -> None:
    """Idempotent."""
