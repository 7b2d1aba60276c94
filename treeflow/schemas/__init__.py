"""Arrow schemas of treeflow's data, and validation of user input at the boundary."""

from treeflow.schemas.episode import (
    CALL_TYPE,
    EPISODE_SCHEMA,
    count_rows,
    expand_paths,
    iter_episode_batches,
    read_episodes,
    validate_episodes,
)
from treeflow.schemas.layout import BIN_SCHEMA, EDGE_VALUES_SCHEMA, LAYOUT_SCHEMA, RESULT_SCHEMA, STEP_METRICS_SCHEMA

__all__ = [
    "BIN_SCHEMA",
    "CALL_TYPE",
    "EDGE_VALUES_SCHEMA",
    "EPISODE_SCHEMA",
    "LAYOUT_SCHEMA",
    "RESULT_SCHEMA",
    "STEP_METRICS_SCHEMA",
    "count_rows",
    "expand_paths",
    "iter_episode_batches",
    "read_episodes",
    "validate_episodes",
]
