"""Probe: one Precompiled graph ahead of time (models/compile/aoti.py) on a device, step by step.

    python -X faulthandler bench/aoti_probe.py CACHE_DIR [cuda|cpu]   # run twice: build, load

On the lent H200 host (torch 2.11) the CUDA package crashed on load, inside the library's
parse_device_str (std::regex recursing until the stack overflowed); this probe narrows it.
"""

import json
import sys

from treeflow.compile_cache import configure

configure(sys.argv[1])
import torch  # noqa: E402

from treeflow.models.compile import precompiled  # noqa: E402
from treeflow.models.config.model import ModelConfig  # noqa: E402
from treeflow.models.reference.decoder import DecoderLayer  # noqa: E402


def mlp_block(layer, x_NH):
    return x_NH + layer.mlp(layer.post_attention_layernorm(x_NH))


device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
torch.manual_seed(0)
layer = DecoderLayer(ModelConfig.tiny()).eval().to(device=device, dtype=torch.bfloat16)
fn = precompiled.Precompiled(mlp_block, backend="inductor", name="probe_mlp_block", dynamic=(1,),
                             ahead_of_time=True)
out = {}
with torch.no_grad():
    for n in (40, 23):
        x = torch.randn(n, 64, device=device, dtype=torch.bfloat16)
        print("calling", n, flush=True)
        got = fn(layer, x)
        print("called", n, flush=True)
        out[n] = (got.float() - mlp_block(layer, x).float()).abs().max().item()
print(json.dumps({"diff": out, "stats": precompiled.stats()["probe_mlp_block"],
                  "dynamo": "torch._dynamo" in sys.modules}), flush=True)
