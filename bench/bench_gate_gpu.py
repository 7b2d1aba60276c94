"""The validation gate on GPUs: `treeflow gate` on a random MoE checkpoint, bf16, CP=1 or 2.

By default it writes a random checkpoint of Qwen3-30B-A3B's layer shape
(hidden 2048, 128 experts, top-8, moe_intermediate 768, 32 heads / 4 KV heads,
head_dim 128, vocabulary 151936) with `--layers` layers, and runs the gate
as a user types it, in a subprocess: 16 multi-turn episodes (4x4 groups, or
`--group-size 16`) sampled with their routes captured, through the queue,
one optimizer step with `--routing replay`, published weights, a refit and
16 more episodes scored by the trainer. `--context-parallel 2` trains in two
processes, one GPU each (the design's gate: routing replay and CP=2), with
every bin's nodes split between them. It records the gate's figures
(retained/sampled, calls, generated tokens, masks by reason, losses,
gradient norm, generation KL, route agreement, refit version) and the
process seconds, in $OUT/bench_gate_gpu.json (or bench/results). The gate
passes in bf16 at generation KL <= 1e-3 (`--max-gen-kl`) and with every
*decided* route agreeing (`route_agreement_decided`, near-ties left out; the
raw `route_agreement` is reported too).

After the gate, on the same checkpoint, `route_margins` (bench/bench_route_margins.py)
samples `--margin-groups` more groups and prints the top-k margin of every
row whose recomputed route disagrees, in units of the near-tie band: whether
every disagreement is a near-tie (`every_disagreement_a_near_tie`). With
`--smoke` it runs on a small random MoE in bf16 (the gate's tiny model has
no experts); `--margin-groups 0` skips it.

    PYTHONUNBUFFERED=1 python bench/bench_gate_gpu.py                    # one H200, MoE, bf16
    PYTHONUNBUFFERED=1 python bench/bench_gate_gpu.py --context-parallel 2   # two H200s, CP=2
    python bench/bench_gate_gpu.py --model DIR                           # your checkpoint
    python bench/bench_gate_gpu.py --smoke --device cpu                  # logic check: tiny dense
    python bench/bench_gate_gpu.py --smoke --device cpu --context-parallel 2   # ... as 2 gloo ranks
    PYTHONUNBUFFERED=1 python bench/bench_gate_gpu.py --design --margin-groups 0   # design, one GPU
    python bench/bench_gate_gpu.py --design --smoke --device cpu --dtype bfloat16  # its logic check

`--design` is the design's gate configuration on one GPU (CP=1): a random Nemotron-H MoE + MTP
checkpoint (~1.8B, bench_hybrid_gpu.py's `nemotron-h-moe` shape, and one MTP layer's tensors),
`--group-size 16 --episodes 16 --routing replay`, bf16, in $OUT/bench_gate_gpu_design.json;
`--queue-backend transferqueue` where Ray and TransferQueue are installed (the design's queue).

The bf16 floor (`--design`; `--floor-episodes N`, 0 skips it): the gate keeps its sampled
episodes (`--episodes-out`), and bench/gate_kl_floor.py scores the first N of the round the
step trained on (sampled with the checkpoint's weights) with transformers in float32 (the
captured routes forced), transformers in bf16 and under bf16 autocast, and treeflow's bf16
trainer, each as the gate's k3 estimator against float32 (`kl_floor`): "gen_kl X vs the bf16
floor Y", Y = transformers bf16 vs transformers autocast on the same tokens.

The card's peak (`card_peak`): while the gate runs, `nvidia-smi --query-gpu=memory.used -lms
100` is sampled, and the largest memory in use on each GPU is recorded (MiB, every process on
the card: the sampler and the trainer together, their CUDA contexts and cached blocks), with the
card's total; the gate's own `sampler` figures say what the sampler held (issue 44: its model
is released while the trainer steps). Issue 44's run, the 4-layer Qwen3-30B-A3B shape on one
80 GB card: `PYTHONUNBUFFERED=1 python bench/bench_gate_gpu.py --layers 4 --margin-groups 0`.
Without nvidia-smi (or on CPU) `card_peak` says why it is absent.

`--smoke` uses the built-in dense tiny model (no routes; `--routing` left
out) at tiny sizes; `--queue-backend transferqueue` runs the gate through
TransferQueue (Ray must be importable).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)  # bench_hybrid_gpu's shapes, bench_route_margins


def qwen3_30b_a3b_shape(layers: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "norm_topk_prob": True, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "router_aux_loss_coef": 0.001,
            "output_router_logits": False}


def write_random_moe(path: str, layers: int, device: str) -> float:
    """A random checkpoint of the shape above (needs the MoE code); seconds taken."""
    import torch

    from treeflow.models import ModelConfig, save_model
    from treeflow.models.checkpoint import seeded_decoder

    t0 = time.perf_counter()
    config = ModelConfig.from_hf_dict(qwen3_30b_a3b_shape(layers))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    save_model(seeded_decoder(config, device=device, dtype=dtype), path)
    return round(time.perf_counter() - t0, 1)


def write_design_model(path: str, device: str, smoke: bool) -> float:
    """The design's gate model class: a random Nemotron-H with MoE blocks (bench_hybrid_gpu.py's
    `nemotron-h-moe`, ~1.8B; `--smoke`: `smoke-moe`) written by transformers, and one MTP
    layer's tensors (loaded frozen, never run, as in a Nemotron-H MTP checkpoint); seconds."""
    import torch
    import transformers
    from bench_hybrid_gpu import SHAPES
    from safetensors.torch import load_file, save_file

    t0 = time.perf_counter()
    torch.manual_seed(0)
    cfg = transformers.NemotronHConfig(**SHAPES["smoke-moe" if smoke else "nemotron-h-moe"],
                                       num_nextn_predict_layers=1)
    with torch.device(device):
        model = transformers.NemotronHForCausalLM(cfg)
    model.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    last = os.path.join(path, files[-1])
    state = load_file(last)
    g = torch.Generator().manual_seed(3)
    h = cfg.hidden_size
    mtp = {"mtp.layers.0.norm.weight": torch.randn(h, generator=g).to(torch.bfloat16),
           "mtp.layers.0.eh_proj.weight": torch.randn(h, 2 * h, generator=g)}
    save_file({**state, **mtp}, last, metadata={"format": "pt"})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):  # sharded: the index names the file holding each tensor
        with open(index) as f:
            idx = json.load(f)
        idx["weight_map"].update({k: files[-1] for k in mtp})
        with open(index, "w") as f:
            json.dump(idx, f)
    return round(time.perf_counter() - t0, 1)


def has_experts(model: str) -> bool:
    if model == "tiny":
        return False
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    return bool(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts"))


def margins(args, model: str | None, dtype: str, work: str) -> dict:
    """The route-margin diagnostic on `model` (None: a small random MoE, for --smoke)."""
    from bench_route_margins import route_margins, write_smoke_moe
    from treeflow.programs.rollout import Rollout

    if model is None:
        model = os.path.join(work, "margins-moe")
        write_smoke_moe(model)
        dtype = "bfloat16"   # where the near-ties are
    num = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    rollout = Rollout(group_size=args.group_size, turns=num(args.turns),
                      prompt_tokens=num(args.prompt_tokens),
                      completion_tokens=num(args.completion_tokens),
                      tool_tokens=num(args.tool_tokens),
                      seed=1)   # other groups than the gate's
    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)
    print(f"route margins: {args.margin_groups} group(s) on {model}", flush=True)
    res = route_margins(model, device=args.device, dtype=dtype, rollout=rollout,
                        groups=args.margin_groups, layout=args.layout)
    print(json.dumps({k: res[k] for k in ("rows", "disagree", "near_ties", "disagree_decided",
                                          "every_disagreement_a_near_tie",
                                          "disagree_margin_over_band")}), flush=True)
    return res


def kl_floor(model: str, kept: str, args) -> dict:
    """bench/gate_kl_floor.py's figures on the trained round's first --floor-episodes."""
    import pyarrow.compute as pc
    from gate_kl_floor import floor

    from treeflow.schemas.episode_files import read_episodes

    eps = read_episodes(kept)
    first = eps.filter(pc.equal(eps.column("weight_version"), 0))
    t0 = time.perf_counter()
    print(f"bf16 floor: {args.floor_episodes} of {first.num_rows} episodes", flush=True)
    res = floor(model, first, device=args.device, max_episodes=args.floor_episodes)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res), flush=True)
    return res


class CardPeak:
    """The largest memory.used per GPU that nvidia-smi reports while the block runs (sampled
    every `interval_ms`); `result()` is those peaks in MiB with the cards' totals, or why not."""

    def __init__(self, device: str, interval_ms: int = 100):
        self.device, self.interval_ms = device, interval_ms
        self.peak: dict = {}
        self.total: dict = {}
        self.samples, self.why, self.proc, self.thread = 0, None, None, None

    def __enter__(self):
        import shutil
        import threading

        if not self.device.startswith("cuda"):
            self.why = f"device {self.device}: no card to watch"
        elif shutil.which("nvidia-smi") is None:
            self.why = "nvidia-smi is not on PATH"
        else:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                 "--format=csv,noheader,nounits", f"--loop-ms={self.interval_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.thread = threading.Thread(target=self._read, daemon=True)
            self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                continue
            gpu, used, total = (int(p) for p in parts)
            self.peak[gpu] = max(self.peak.get(gpu, 0), used)
            self.total[gpu] = total
            self.samples += 1

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.thread.join(timeout=30)
        return False

    def result(self) -> dict:
        if self.why is not None:
            return {"absent": self.why}
        return {"used_mib_max": {str(k): v for k, v in sorted(self.peak.items())},
                "total_mib": {str(k): v for k, v in sorted(self.total.items())},
                "samples": self.samples, "interval_ms": self.interval_ms, "tool": "nvidia-smi"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a random MoE one)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the random MoE checkpoint")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--group-size", type=int, default=4, help="4: 4x4 groups; 16: one group")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", default="3,4", help="calls per episode, lo,hi")
    ap.add_argument("--prompt-tokens", default="256,512")
    ap.add_argument("--completion-tokens", default="32,64")
    ap.add_argument("--tool-tokens", default="32,96")
    ap.add_argument("--layout", default="tree")
    ap.add_argument("--queue-backend", default="embedded")
    ap.add_argument("--context-parallel", type=int, default=1,
                    help="trainer processes per bin (one GPU each on cuda)")
    ap.add_argument("--max-gen-kl", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny dense model and sizes")
    ap.add_argument("--design", action="store_true",
                    help="the design's configuration: a random Nemotron-H MoE + MTP checkpoint "
                         "(--smoke: a small one), one group of 16, --routing replay")
    ap.add_argument("--floor-episodes", type=int, default=4,
                    help="--design: episodes of the trained round scored for the bf16 floor "
                         "(bench/gate_kl_floor.py; 0 skips it)")
    ap.add_argument("--margin-groups", type=int, default=1,
                    help="groups sampled for the route-margin diagnostic (0: skip it)")
    args = ap.parse_args()
    if args.design:
        args.group_size, args.episodes = 16, 16
    if args.smoke:
        args.turns, args.prompt_tokens, args.completion_tokens, args.tool_tokens = \
            "2,3", "8,16", "3,6", "2,4"
        args.model = args.model or (None if args.design else "tiny")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.context_parallel:
            raise SystemExit(f"--context-parallel {args.context_parallel} needs as many GPUs; "
                             f"this host has {torch.cuda.device_count()}")
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    cp = "" if args.context_parallel == 1 else f"_cp{args.context_parallel}"
    name = "bench_gate_gpu" + ("_design" if args.design else "") + cp
    out_file = os.path.join(out_dir, args.out or (f"{name}_smoke.json" if args.smoke
                                                  else f"{name}.json"))
    res: dict = {"settings": {**vars(args), "dtype": dtype}}
    work = tempfile.mkdtemp(prefix="treeflow-gate-bench-")
    model = args.model
    if model is None and args.design:
        model = os.path.join(work, "model")
        print("writing a random Nemotron-H MoE + MTP checkpoint", flush=True)
        res["checkpoint_seconds"] = write_design_model(model, args.device, args.smoke)
    elif model is None:
        model = os.path.join(work, "model")
        print(f"writing a random Qwen3-30B-A3B-shaped checkpoint, {args.layers} layers", flush=True)
        res["checkpoint_seconds"] = write_random_moe(model, args.layers, args.device)
    routed = has_experts(model)
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, *site, os.environ.get("PYTHONPATH", "")])}
    pair = lambda s: s.split(",")  # noqa: E731
    cmd = [sys.executable, "-m", "treeflow.cli", "gate", "--model", model, "--device", args.device,
           "--dtype", dtype, "--layout", args.layout, "--episodes", str(args.episodes),
           "--group-size", str(args.group_size), "--turns", *pair(args.turns),
           "--prompt-tokens", *pair(args.prompt_tokens),
           "--completion-tokens", *pair(args.completion_tokens),
           "--tool-tokens", *pair(args.tool_tokens), "--queue-backend", args.queue_backend,
           "--context-parallel", str(args.context_parallel),
           "--json", "-o", os.path.join(work, "gate.json"),
           "--episodes-out", os.path.join(work, "episodes.arrow"),
           *(["--threads", "1"] if args.device == "cpu" else []),
           *(["--routing", "replay"] if routed else []),
           *(["--max-gen-kl", args.max_gen_kl] if args.max_gen_kl else [])]
    res["command"] = " ".join(cmd[1:])
    print(res["command"], flush=True)
    t0 = time.perf_counter()
    with CardPeak(args.device) as card:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    res["process_seconds"] = round(time.perf_counter() - t0, 2)
    res["card_peak"] = card.result()
    print(f"card peak: {json.dumps(res['card_peak'])}", flush=True)
    res["exit_code"] = proc.returncode
    if proc.stdout.strip():
        res["gate"] = json.loads(proc.stdout.strip().splitlines()[-1])
    res["stderr_tail"] = proc.stderr[-2000:]

    def write():
        with open(out_file, "w") as f:
            json.dump(res, f, indent=1)

    write()  # the gate's figures survive a diagnostic that runs past a device call's limit
    kept = os.path.join(work, "episodes.arrow")
    if args.design and args.floor_episodes and os.path.exists(kept):
        res["kl_floor"] = kl_floor(model, kept, args)
        write()
    if args.margin_groups and (routed or args.smoke):
        res["route_margins"] = margins(args, model if routed else None, dtype, work)
        write()
    print(json.dumps(res, indent=1))
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
