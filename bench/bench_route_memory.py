"""Host memory for MoE routes per million tokens: what the converter holds, and what is stored.

Synthetic calls at a Qwen3-30B-A3B route shape (48 MoE layers x top_k 8, 128 experts) go through
`OpenAITokens` (vLLM's OpenAI payload) and the episode table; tracemalloc measures the Python
route lists the converter builds for a batch, and Arrow's buffers the route column's bytes. The
int16 column is today's storage; uint8 is what the same ids take where the expert count allows
(computed, not stored: the episode schema still stores int16). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import tracemalloc

import numpy as np
import pyarrow as pa

from treeflow.io import OpenAITokens
from treeflow.schemas.episode import EPISODE_SCHEMA


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per call")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    prompt = a.tokens // 2
    conv = OpenAITokens(num_experts=a.experts)
    records = []
    for i in range(a.calls):
        ref = rng.integers(0, a.experts, (a.tokens - 1, a.layers, a.top_k), dtype=np.int16)
        records.append({"episode_id": str(i), "calls": [{
            "prompt_token_ids": list(range(1, prompt + 1)),
            "prompt_routed_experts": ref[:prompt].tolist(),
            "choices": [{"token_ids": list(range(1, a.tokens - prompt + 1)),
                         "routed_experts": ref[prompt:].tolist()}]}]})
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rows = [conv.episode(r, "bench", path="bench", line=i) for i, r in enumerate(records)]
    python_lists = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    for r in rows:
        r["sample_index"] = int(r["episode_id"])
    pool = pa.default_memory_pool()
    arrow0 = pool.bytes_allocated()
    table = pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA)
    routes = table.column("calls").combine_chunks().flatten().field("routed_experts")
    arrow_bytes = routes.nbytes
    peak_arrow = pool.bytes_allocated() - arrow0
    tokens = a.calls * a.tokens
    per_m = 1e6 / tokens
    width = a.layers * a.top_k
    out = {
        "shape": {"calls": a.calls, "tokens_per_call": a.tokens, "layers": a.layers,
                  "top_k": a.top_k, "experts": a.experts, "route_width": width},
        "tokens": tokens,
        "converter_python_lists_MiB_per_Mtok": round(python_lists * per_m / 2**20, 1),
        "arrow_int16_column_MiB_per_Mtok": round(arrow_bytes * per_m / 2**20, 1),
        "arrow_pool_during_build_MiB_per_Mtok": round(peak_arrow * per_m / 2**20, 1),
        "uint8_ids_plus_offsets_MiB_per_Mtok": round((width + 4) * 1e6 / 2**20, 1),
        "converter_holds_both_at_batch_end_MiB_per_Mtok": round(
            (python_lists + arrow_bytes) * per_m / 2**20, 1),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
