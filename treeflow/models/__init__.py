"""Policy backends (the backend protocol, the reference PyTorch decoder; megatron-core on
request) and tree-attention kernels."""

from treeflow.models.attention import KERNELS, AttentionPlan, Capabilities
from treeflow.models.backend import (BACKENDS, Backend, ReferenceBackend, check_tensor_parallel,
                                     load_backend, tensor_parallel_layout)
from treeflow.models.checkpoint import load_model, save_model
from treeflow.models.config import ModelConfig
from treeflow.models.decoder import Decoder
from treeflow.models.hybrid import HybridDecoder
from treeflow.models.hybrid_config import HybridConfig
from treeflow.models.logprobs import selected_logprobs
from treeflow.models.tuning import Tuning

__all__ = [
    "BACKENDS",
    "Backend",
    "ReferenceBackend",
    "check_tensor_parallel",
    "load_backend",
    "tensor_parallel_layout",
    "KERNELS",
    "AttentionPlan",
    "Capabilities",
    "Decoder",
    "HybridConfig",
    "HybridDecoder",
    "ModelConfig",
    "load_model",
    "save_model",
    "selected_logprobs",
    "Tuning",
]
