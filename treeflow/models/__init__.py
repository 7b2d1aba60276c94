"""Policy backends and tree-attention kernels: the reference PyTorch decoder."""

from treeflow.models.attention import KERNELS, AttentionPlan, Capabilities
from treeflow.models.checkpoint import load_model, save_model
from treeflow.models.config import ModelConfig
from treeflow.models.decoder import Decoder
from treeflow.models.logprobs import selected_logprobs

__all__ = [
    "KERNELS",
    "AttentionPlan",
    "Capabilities",
    "Decoder",
    "ModelConfig",
    "load_model",
    "save_model",
    "selected_logprobs",
]
