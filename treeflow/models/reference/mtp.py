"""Multi-token-prediction (MTP) layers: bypassed in RL, never trained, saved back unchanged.

Some checkpoints carry MTP heads next to the policy (Nemotron-H's `mtp.*`,
DeepSeek-V3 / GLM's extra `model.layers.{N+k}`, Qwen3-Next's `mtp.*`, MiMo's
`model.mtp_layers.*`). In RL the MTP loss must not drive the policy step, and
the policy's logprobs never depend on MTP. So for a family with a bypass the
MTP tensors are read in their stored dtype into a plain dict beside the module
(`HybridDecoder.frozen_tensors`): not parameters, so no optimizer, gradient
all-reduce, clipping or dtype/device move ever sees them; never executed; and
written back byte for byte under their original names by `save_model`. The
cost is host memory for one copy of the MTP weights. A checkpoint with MTP
layers (in its config or its tensors) of a family without a bypass is refused
by name rather than run with its MTP silently dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["BYPASS_PREFIXES", "LAYER_MTP", "is_mtp_tensor", "mtp_layer_count", "refuse_mtp",
           "trailing_mtp_layer"]

# families whose MTP tensors treeflow can hold frozen, by the prefix they live under
BYPASS_PREFIXES = {"NemotronHForCausalLM": ("mtp.",)}
# families whose MTP layers are `model.layers.{N+k}` past the config's N layers: held frozen
LAYER_MTP = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers",
               "mtp_num_layers")
_MTP_NAME = re.compile(r"^(mtp\.|model\.mtp_layers\.|model\.mtp\.|backbone\.mtp\.)")


def mtp_layer_count(d: Mapping[str, Any]) -> int:
    """MTP layers a config.json declares (0 when none)."""
    return max((int(d.get(k) or 0) for k in _COUNT_KEYS), default=0)


def is_mtp_tensor(name: str) -> bool:
    """A tensor name under an MTP prefix (`mtp.`, `model.mtp_layers.`, ...). DeepSeek-V3 / GLM
    keep MTP as extra `model.layers.{N+k}`, which only their config tells apart from a wrong
    layer count: those are refused by their config's `num_nextn_predict_layers`."""
    return bool(_MTP_NAME.match(name))


def trailing_mtp_layer(config, name: str) -> bool:
    """`name` lies in one of the `mtp_layers` extra `model.layers.{N+k}` of a LAYER_MTP family."""
    if config.architecture not in LAYER_MTP:
        return False
    m = _LAYER.match(name)
    n = config.num_hidden_layers
    return m is not None and n <= int(m.group(1)) < n + getattr(config, "mtp_layers", 0)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def bypassed(architecture: str, name: str) -> bool:
    return name.startswith(BYPASS_PREFIXES.get(architecture, ()))


def refuse_mtp(architecture: str, what: str) -> None:
    raise ValueError(f"{architecture} checkpoint has multi-token-prediction (MTP) layers ({what}); "
                     f"treeflow bypasses MTP only for {sorted(BYPASS_PREFIXES)} (frozen, never "
                     "run, saved back unchanged); running this one would drop or train its MTP "
                     "silently: strip the MTP layers from the checkpoint or use a supported family")
