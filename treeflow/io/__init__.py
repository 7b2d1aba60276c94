"""Getting real data in and out: converters from chat logs to episodes, and metric logs.

Each converter is a frozen config with one method, `episode(record, where, *,
path, line) -> dict`, that turns one JSON line into one episode row;
`convert` streams files through it into a validated episode file, or ATIF JSON lines.
"""

from treeflow.io.atif import ATIFFileWriter, ATIFTrajectories, episode_to_atif
from treeflow.io.chat_template import ChatTemplateTokens, load_tokenizer
from treeflow.io.convert import ConvertReport, convert, episodes_from_jsonl
from treeflow.io.nemo_rl import NemoRLMessageLog
from treeflow.io.openai import OpenAITokens
from treeflow.io.records import FieldMap, read_jsonl
from treeflow.io.sink import EpisodeFileWriter
from treeflow.io.tensorboard import TensorBoardLog

FORMATS = {"openai": OpenAITokens, "chat": ChatTemplateTokens, "nemo-rl": NemoRLMessageLog,
           "atif": ATIFTrajectories}

__all__ = [
    "FORMATS",
    "ATIFFileWriter",
    "ATIFTrajectories",
    "ChatTemplateTokens",
    "ConvertReport",
    "EpisodeFileWriter",
    "FieldMap",
    "NemoRLMessageLog",
    "OpenAITokens",
    "TensorBoardLog",
    "convert",
    "episode_to_atif",
    "episodes_from_jsonl",
    "load_tokenizer",
    "read_jsonl",
]
