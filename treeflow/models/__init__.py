"""Policy backends (the backend protocol, the reference PyTorch decoder; megatron-core on
request) and tree-attention kernels.

Names load on first use (treeflow/_lazy.py): `treeflow.models.config` and `.tuning` are
plain Python and do not import torch.
"""

from treeflow._lazy import lazy_exports

_WHERE = {
    "BACKENDS": "backend",
    "Backend": "backend_base",
    "ReferenceBackend": "backend",
    "check_tensor_parallel": "backend_base",
    "load_backend": "backend",
    "tensor_parallel_layout": "backend",
    "KERNELS": "attention",
    "AttentionPlan": "attention",
    "Capabilities": "attention",
    "Decoder": "decoder",
    "HybridConfig": "hybrid_config",
    "HybridDecoder": "hybrid",
    "ModelConfig": "config",
    "load_model": "checkpoint",
    "save_model": "checkpoint",
    "selected_logprobs": "logprobs",
    "Tuning": "tuning",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
