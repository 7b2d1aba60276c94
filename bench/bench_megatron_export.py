"""Memory and time of the megatron backend's Hugging Face export under tensor parallelism.

Every rank loads its shard of a seeded Llama-shaped model (about 160M
parameters by default, float32), then `MegatronBackend.save` runs once while
each rank records what the export added on top of the loaded model:

- `rss_peak_delta_bytes`: the process's peak resident set during the export
  minus its resident set just before (Linux: the peak is reset through
  /proc/self/clear_refs and freed heap returned with malloc_trim first);
- on CUDA, `device_peak_delta_bytes`: torch's peak allocated device memory
  during the export minus what was allocated before it;
- `seconds` of the export.

`model_bytes` is the unsharded model's size. Run under tensor parallelism T:

    python bench/bench_megatron_export.py                    # T=2 over gloo on CPU
    python bench/bench_megatron_export.py --device cuda      # T=2 over NCCL, two GPUs

The parent launches itself under torchrun (T processes) and prints one JSON
object (per rank, in rank order); writes $OUT/bench_megatron_export.json if
OUT is set.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", module="megatron")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from treeflow.models import ModelConfig, load_backend  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)


def _status(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Return freed heap to the OS and restart the peak resident set; the resident set now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def worker(args) -> None:
    device = "cpu"
    if args.device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    backend = load_backend("megatron", ModelConfig(**SHAPE), device=device,
                           tensor_parallel=args.tp, sequence_parallel=False)
    model_bytes = sum(p.nbytes * (args.tp if getattr(p, "tensor_model_parallel", False) else 1)
                      for _, p in backend.named_parameters())
    dist.barrier()
    rss = _reset_peak()
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
    start = time.perf_counter()
    backend.save(os.path.join(args.workdir, "export"))
    seconds = time.perf_counter() - start
    row = {"rank": dist.get_rank(), "model_bytes": model_bytes, "seconds": round(seconds, 3),
           "rss_peak_delta_bytes": _status("VmHWM") - rss}
    if device != "cpu":
        row["device_peak_delta_bytes"] = torch.cuda.max_memory_allocated() - allocated
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--workdir", default=None, help="where the export goes (default: a temp dir)")
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_out:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        out = os.path.join(workdir, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.tp), os.path.abspath(__file__), "--tp", str(args.tp), "--device",
               args.device, "--workdir", workdir, "--worker-out", out]
        subprocess.run(cmd, check=True)
        with open(out) as f:
            rows = json.load(f)
    result = {"tp": args.tp, "device": args.device, "shape": SHAPE, "ranks": rows}
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_megatron_export.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
