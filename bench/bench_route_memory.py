"""Host memory for MoE routes per million tokens: the converter's real path, end to end.

Synthetic calls at a Qwen3-30B-A3B route shape (48 MoE layers x top_k 8, 128 experts) are
written once as vLLM OpenAI-server JSON lines (`prompt_routed_experts` + the choice's
`routed_experts`). Each variant then runs `treeflow.io.convert` on them into an Arrow file in
a fresh process (so peaks are its own): `uint8` (--num-experts 128: the compact storage) and
`int16` (no --num-experts); with `--before DIR` (a source tree of treeflow before the compact
storage) the same convert call runs on that tree too. Per variant: tracemalloc's peak (Python
objects and numpy buffers), the Arrow memory pool's peak, the peak RSS over the RSS before
converting (VmHWM, reset where the kernel allows), and the route column's bytes in the written
file, each per million tokens; `*_over_one_call` subtracts a run on one call, so what does not
grow with the batch (imports, the JSON parse and int64 decode of one line) drops out.

The first section, `one_batch`, is the micro view of the current tree: the route arrays the
converter holds for one batch before the column is built, and the column's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np

MiB = 2**20


def _records(a, calls=None):
    rng = np.random.default_rng(0)
    prompt = a.tokens // 2
    for i in range(a.calls if calls is None else calls):
        ref = rng.integers(0, a.experts, (a.tokens - 1, a.layers, a.top_k), dtype=np.int16)
        yield {"episode_id": str(i), "calls": [{
            "prompt_token_ids": list(range(1, prompt + 1)),
            "prompt_routed_experts": ref[:prompt].tolist(),
            "choices": [{"token_ids": list(range(1, a.tokens - prompt + 1)),
                         "routed_experts": ref[prompt:].tolist()}]}]}


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def child(src: str, out: str, num_experts: int | None) -> dict:
    """One convert in this (fresh) process; its peaks in bytes."""
    import pyarrow as pa

    from treeflow.io import OpenAITokens, convert
    from treeflow.schemas import read_episodes

    conv = OpenAITokens(num_experts=num_experts)
    try:
        with open("/proc/self/clear_refs", "w") as f:   # reset VmHWM to the current RSS
            f.write("5")
        reset = True
    except OSError:
        reset = False
    rss0 = _vm("VmRSS:")
    pool = pa.default_memory_pool()
    tracemalloc.start()
    t0 = time.perf_counter()
    report = convert([src], out, conv, batch_rows=256)
    seconds = time.perf_counter() - t0
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    hwm, pool_peak = _vm("VmHWM:"), pool.max_memory()
    table = read_episodes(out)
    routes = table.column("calls").chunk(0).flatten().field("routed_experts")
    return {"tokens": report.exact_tokens, "traced_peak": traced_peak,
            "arrow_pool_peak": pool_peak, "rss_peak_over_start": hwm - rss0,
            "rss_peak_reset": reset, "route_column_bytes": routes.nbytes,
            "stored_ids": str(routes.type.value_type.value_type), "seconds": round(seconds, 2)}


def one_batch(a) -> dict:
    """The current tree's converter on one batch: its per-call route arrays, then the column."""
    import pyarrow as pa

    from treeflow.io import OpenAITokens
    from treeflow.io.convert import _table

    conv = OpenAITokens(num_experts=a.experts)
    records = list(_records(a))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rows = [conv.episode(r, "bench", path="bench", line=i) for i, r in enumerate(records)]
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    for r in rows:
        r["sample_index"] = int(r["episode_id"])
    pool = pa.default_memory_pool()
    arrow0 = pool.bytes_allocated()
    table = _table(rows, ["bench"] * len(rows), conv.route_type)
    routes = table.column("calls").chunk(0).flatten().field("routed_experts")
    per_m = 1e6 / (a.calls * a.tokens) / MiB
    return {"converter_route_arrays_MiB_per_Mtok": round(held * per_m, 1),
            "route_column_MiB_per_Mtok": round(routes.nbytes * per_m, 1),
            "arrow_pool_during_build_MiB_per_Mtok": round((pool.bytes_allocated() - arrow0) * per_m, 1),
            "stored_ids": str(routes.type.value_type.value_type)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per call")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--before", default=None, help="a treeflow source tree to measure as 'before'")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        src, out, experts = a.child
        print(json.dumps(child(src, out, None if experts == "none" else int(experts))))
        return
    width = a.layers * a.top_k
    result = {"command": "python bench/bench_route_memory.py " + " ".join(sys.argv[1:]).replace(
                  a.before or "\0", "DIR").replace(a.out or "\0", "FILE"),
              "shape": {"calls": a.calls, "tokens_per_call": a.tokens, "layers": a.layers,
                        "top_k": a.top_k, "experts": a.experts, "route_width": width},
              "one_batch": one_batch(a),
              "ideal_MiB_per_Mtok": {"uint8": round(width * 1e6 / MiB, 1),
                                     "int16": round(2 * width * 1e6 / MiB, 1)}}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [("uint8", here, str(a.experts)), ("int16", here, "none")]
    if a.before:
        runs.append(("before_int16", os.path.abspath(a.before), str(a.experts)))
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {}
        for size, calls in (("one", 1), ("all", a.calls)):
            srcs[size] = os.path.join(tmp, f"{size}.jsonl")
            with open(srcs[size], "w") as f:
                for r in _records(a, calls):
                    f.write(json.dumps(r) + "\n")
        result["jsonl_MiB"] = round(os.path.getsize(srcs["all"]) / MiB, 1)
        for name, tree, experts in runs:
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
            m = {}
            for size, src in srcs.items():
                got = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", src,
                                      os.path.join(tmp, f"{name}-{size}.arrow"), experts], env=env,
                                     capture_output=True, text=True, check=True, cwd=tree)
                m[size] = json.loads(got.stdout.strip().splitlines()[-1])
            one, full = m["one"], m["all"]
            per_m = 1e6 / full["tokens"] / MiB
            slope = 1e6 / (full["tokens"] - one["tokens"]) / MiB  # one call's run subtracted:
            result[name] = {                                      # imports, one line's parse
                "stored_ids": full["stored_ids"],
                "route_column_MiB_per_Mtok": round(full["route_column_bytes"] * per_m, 1),
                "seconds": full["seconds"], "rss_peak_reset": full["rss_peak_reset"],
                **{f"{k}_MiB_per_Mtok": round(full[k] * per_m, 1)
                   for k in ("traced_peak", "arrow_pool_peak", "rss_peak_over_start")},
                **{f"{k}_over_one_call_MiB_per_Mtok": round((full[k] - one[k]) * slope, 1)
                   for k in ("traced_peak", "arrow_pool_peak", "rss_peak_over_start")}}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        from treeflow.atomic import atomic_open

        with atomic_open(a.out, "w", what="bench results") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
