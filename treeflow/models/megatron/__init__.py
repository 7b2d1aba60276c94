"""The megatron-core backend: GPTModel with tree core attention, tensor parallelism.

Imported only when `backend="megatron"` is asked for; it needs megatron-core
(`pip install 'treeflow[megatron]'`). Transformer Engine is neither needed nor
used (the layer spec is MCore's local one); an installed but broken TE makes
`import megatron.core` itself fail.
"""

try:
    import megatron.core  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("the megatron backend needs megatron-core: pip install 'treeflow[megatron]' "
                      f"(import failed: {e})") from e

from treeflow.models.megatron.backend import MegatronBackend, build_gpt_model
from treeflow.models.megatron.convert import hf_to_mcore, mcore_to_hf, shard, unshard
from treeflow.models.megatron.logprobs import vocab_parallel_logprobs
from treeflow.models.megatron.spec import (TreeCoreAttention, TreeRMSNorm, tree_block_spec,
                                           tree_layer_spec)

__all__ = [
    "MegatronBackend",
    "TreeCoreAttention",
    "TreeRMSNorm",
    "build_gpt_model",
    "hf_to_mcore",
    "mcore_to_hf",
    "shard",
    "tree_block_spec",
    "tree_layer_spec",
    "unshard",
    "vocab_parallel_logprobs",
]
