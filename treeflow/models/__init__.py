"""Policy backends (the backend protocol, the reference PyTorch decoders; megatron-core on
request) and the kernels they run on, one room per concept:

    config/      model shapes from config.json (plain Python)
    reference/   the decoders, one per family
    attention/   tree attention kernels and context parallelism
    ssm/         Mamba-2 and Gated DeltaNet over a tree
    moe/         MoE blocks, routing replay, the expert path
    heads/       selected-target logprobs, the fused loss
    compile/     compiled and recomputed layers, the graph cache
    megatron/    the megatron-core backend

At the top: the backend protocol (backend.py, backend_base.py), checkpoint I/O, adopt,
families.py (what runs where), support.py (what runs with what) and tuning.py.

Names load on first use (treeflow/_lazy.py): `treeflow.models.config.model` and `.tuning` are
plain Python and do not import torch. The config families other than the dense/MoE decoder's
(config/hybrid.py, gdn.py, gemma3.py, gpt_oss.py, deepseek.py, plain Python too) are imported
here, whatever is asked for, because that is where they register with
`ModelConfig.from_hf_dict` (config/model.py imports none of them).
"""

from treeflow._lazy import lazy_exports
from treeflow.models.config import deepseek as _deepseek_config  # noqa: F401 (registers its family)
from treeflow.models.config import gdn as _gdn_config  # noqa: F401 (registers its family)
from treeflow.models.config import gemma3 as _gemma3_config  # noqa: F401 (registers its family)
from treeflow.models.config import gpt_oss as _gpt_oss_config  # noqa: F401 (registers its family)
from treeflow.models.config import hybrid as _hybrid_config  # noqa: F401 (registers its family)

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "adopt": ("adopt_module",),
    "backend": ("ReferenceBackend", "load_backend", "tensor_parallel_layout"),
    "backend_base": ("Backend", "check_tensor_parallel"),
    "attention.tree": ("KERNELS", "AttentionPlan", "Capabilities"),
    "reference.decoder": ("Decoder",),
    "config.hybrid": ("HybridConfig",),
    "reference.hybrid": ("HybridDecoder",),
    "config.model": ("BACKENDS", "ModelConfig"),
    "checkpoint": ("load_model", "save_model"),
    "heads.logprobs": ("selected_logprobs",),
    "tuning": ("Tuning",),
})
