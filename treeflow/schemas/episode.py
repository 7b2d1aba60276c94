"""The episode schema, its validation and the readers of episode files, by one import path.

`treeflow.schemas.episode` names what three modules hold: the schema (episode_schema.py:
one row per logical sample, every call as the engine ran it), its validation at the edge
(episode_check.py) and the file readers (episode_files.py).
"""

from treeflow.schemas.episode_check import validate_episodes
from treeflow.schemas.episode_files import (count_rows, expand_paths, iter_episode_batches,
                                            open_episode_file, read_episodes)
from treeflow.schemas.episode_schema import (CALL_TYPE, EPISODE_SCHEMA, EXECUTION_TYPE,
                                             SCHEMA_VERSION, concat_episodes, episode_schema,
                                             is_episode_schema, routes_id_type)

__all__ = ["CALL_TYPE", "EPISODE_SCHEMA", "EXECUTION_TYPE", "SCHEMA_VERSION", "concat_episodes",
           "count_rows", "episode_schema", "expand_paths", "is_episode_schema",
           "iter_episode_batches", "open_episode_file", "read_episodes", "routes_id_type",
           "validate_episodes"]
