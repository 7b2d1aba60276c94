"""`python -m treeflow.cli ...`: the `treeflow` console script."""

from treeflow.cli.main import entry

entry()
