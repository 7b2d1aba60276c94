"""`python -m treeflow.cli ...`: the `treeflow` console script."""

import sys

from treeflow.cli.main import main

sys.exit(main())
