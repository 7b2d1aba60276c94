"""Tools: synthetic agentic episodes (synth) and the layout figures of a data set (inspect),
for the `synth`, `inspect` and `plan` commands, tests and benchmarks.

A tool reads and writes data; it never runs a model or an engine, so it imports no torch or
Ray. The trade-off: the synthetic generator lives in the package (tests, benches and users
share one) rather than in tests/. Names load on first use (treeflow/_lazy.py).
"""

from treeflow._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "synth": ("routes_like", "synth_episodes", "write_episodes"),
})
