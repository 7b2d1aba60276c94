"""treeflow: prefix-tree policy execution for RL on multi-turn agentic episodes."""

__version__ = "0.1.0"

__all__ = ["__version__"]
