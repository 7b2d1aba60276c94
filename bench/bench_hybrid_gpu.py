"""Mamba-2 hybrid on trees, through the CLI: bf16 fidelity per fork mode, and tree vs exact speed.

A random Nemotron-H-shaped checkpoint (written by transformers' own
NemotronHForCausalLM: 27 blocks in Nemotron-H's proportions, 12 Mamba-2, 12
relu^2 MLP, 3 attention; ~1.3B parameters) and 512 synthetic episodes in groups
of 8 (`treeflow synth`). Everything below runs as the CLI a user runs:

- fidelity: `treeflow replay --dtype bfloat16` with `--layout tree --ssm-fork
  exact`, `--layout tree --ssm-fork chunk`, `--layout exact` (and each with
  `--ssm-state-dtype bfloat16`), each compared on the first `--ref-episodes`
  episodes with transformers' float32 model run call by call (the oracle); next
  to transformers' own bfloat16 per call. Reported: mean and max |logprob -
  float32 oracle| over the sampled tokens. The fork mode whose tree distance is
  closest to the exact layout's is the better default.
- speed: the same replays' steady seconds (tree vs exact), and `--mode train`
  steady seconds per optimizer step (forward + backward + AdamW, 64 episodes a
  step) for tree (each fork mode) and exact.

`--moe`: the Hybrid MoE class instead (Nemotron-H with MoE blocks in
Nemotron-3-Nano's style: 64 sigmoid-routed relu^2 experts, top-6, scaling 2.5,
a shared expert; 14 blocks, 6 of them MoE; ~1.8B parameters, ~0.5B active).
The episodes carry routes (`synth --routes-from` the checkpoint), every
replay runs `--routing replay`, and the float32 oracle is transformers per
call with the same routes forced into its routers (tests/models/
hybrid_moe_helpers.py); `exact_layout_recompute` shows the distance when the
bf16 routers choose for themselves against transformers' own float32 routing.

`--profile`: bench/bin_profile.py on the largest tree and exact bin of the first window
(torch.profiler, device time by kernel group: scan and conv, attention, matmuls, the rest),
in a subprocess after the replays, with the run's `--ssm-kernel`; `profile` in the JSON.

    PYTHONUNBUFFERED=1 python3 bench/bench_hybrid_gpu.py          # one H200
    PYTHONUNBUFFERED=1 python3 bench/bench_hybrid_gpu.py --moe    # one H200, Hybrid MoE
    python3 bench/bench_hybrid_gpu.py --smoke --device cpu [--moe]  # logic check, tiny sizes

Prints JSON lines as it goes; the result lands in $OUT/bench_hybrid_gpu[_moe].json (or
bench/results/bench_hybrid_gpu[_moe][_smoke].json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "models"))  # the MoE oracle

from bench_cli_gpu import cli  # noqa: E402  (runs `python -m treeflow.cli ...`, parses --json)
import bin_profile  # noqa: E402  (bench/bin_profile.py: a bin's device time by kernel)
from tests.weights import as_loaded  # noqa: E402  (cast as from_pretrained loads: RoPE in float32)

SHAPES = {
    "nemotron-h-1b": dict(vocab_size=131072, hidden_size=2048, intermediate_size=8192,
                          hybrid_override_pattern="M-M-M-M*-" * 3, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, mamba_num_heads=64,
                          mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
                          chunk_size=128, tie_word_embeddings=False),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=96,
                  hybrid_override_pattern="M-M*M-", num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                  n_groups=2, conv_kernel=4, chunk_size=16, tie_word_embeddings=False),
    "nemotron-h-moe": dict(vocab_size=131072, hidden_size=2048, intermediate_size=8192,
                           hybrid_override_pattern="MEM*EMEMEM*EME", num_attention_heads=16,
                           num_key_value_heads=2, head_dim=128, mamba_num_heads=64,
                           mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
                           chunk_size=128, n_routed_experts=64, num_experts_per_tok=6,
                           moe_intermediate_size=768, moe_shared_expert_intermediate_size=1536,
                           routed_scaling_factor=2.5, n_group=1, topk_group=1,
                           tie_word_embeddings=False),
    "smoke-moe": dict(vocab_size=512, hidden_size=64, intermediate_size=96,
                      hybrid_override_pattern="ME*MEM", num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
                      ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
                      n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5,
                      n_group=2, topk_group=1, tie_word_embeddings=False),
}
SYNTH_VOCAB = 32000


def make_checkpoint(shape: str, path: str, device: str):
    """transformers' NemotronHForCausalLM with its own random init, saved in float32."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.NemotronHConfig(**SHAPES[shape])
    with torch.device(device):
        model = transformers.NemotronHForCausalLM(cfg)
    model.save_pretrained(path)
    return model.eval()


def hf_logprobs(model, eps, n: int, dtype, replay: bool = False) -> list[np.ndarray]:
    """transformers per call: the sampled tokens' logprobs of the first n episodes, flattened;
    replay: each call's routed_experts forced into transformers' routers."""
    import contextlib

    import torch

    out = []
    dev = next(model.parameters()).device
    with torch.no_grad(), torch.autocast(dev.type, enabled=False):
        m = as_loaded(model, dtype)
        for row in eps[:n]:
            for call in row["calls"]:
                ids = torch.tensor([call["token_ids"]], device=dev)
                s = call["sampled_start"]
                force = contextlib.nullcontext()
                if replay:
                    from hybrid_moe_helpers import forced_routes

                    force = forced_routes(m, np.asarray(call["routed_experts"]))
                with force:
                    logits = m(ids).logits[0].float()
                lp = torch.log_softmax(logits, -1)[s - 1:-1]
                out.append(lp.gather(-1, ids[0, s:, None])[:, 0].cpu().numpy())
    return out


def distance(got: list[np.ndarray], ref: list[np.ndarray]) -> dict:
    d = np.abs(np.concatenate(got) - np.concatenate(ref))
    return {"mean": round(float(d.mean()), 5), "max": round(float(d.max()), 4)}


def read_logprobs(path: str, n: int) -> list[np.ndarray]:
    import pyarrow as pa

    rows = pa.ipc.open_file(path).read_all().slice(0, n).to_pylist()
    return [np.asarray(c, dtype=np.float64) for r in rows for c in r["logprobs"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shape and data (logic check)")
    ap.add_argument("--episodes", type=int, default=None)
    ap.add_argument("--ref-episodes", type=int, default=None,
                    help="episodes compared with transformers float32 (default 32; smoke 4)")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--no-replay", action="store_true",
                    help="skip the replays (and with them the fidelity figures)")
    ap.add_argument("--no-fidelity", action="store_true",
                    help="skip transformers' per-call reference (speed only)")
    ap.add_argument("--runs", default="tree_exact_fork,tree_chunk_fork,exact_layout",
                    help="which layouts to run, comma-separated (a device call is at most 10 min)")
    ap.add_argument("--state-dtypes", default="float32,bfloat16",
                    help="--ssm-state-dtype values to replay with (each: three replays)")
    ap.add_argument("--moe", action="store_true",
                    help="the Hybrid MoE shape, routed episodes, --routing replay")
    ap.add_argument("--ssm-kernel", default=None, choices=("auto", "torch", "triton"),
                    help="the CLI runs' --ssm-kernel (default: theirs, auto)")
    ap.add_argument("--ssm-precisions", default="auto",
                    help="comma list of --ssm-precision values, each a replay and train run of "
                    "its own (auto: the CLI's default; others keyed _<precision>_products)")
    ap.add_argument("--budget-seconds", type=float, default=None,
                    help="stop each CLI run (stacks printed) once this is spent since start, and "
                         "skip the runs left (a device call is capped)")
    ap.add_argument("--profile", action="store_true",
                    help="bench/bin_profile.py on the first window's largest tree and exact bin")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from treeflow.models.tuning import SSM_PRECISIONS

    bad = set(args.ssm_precisions.split(",")) - set(SSM_PRECISIONS)
    if bad:
        ap.error(f"--ssm-precisions: unknown {sorted(bad)}; choose from {SSM_PRECISIONS}")
    shape = ("smoke" if args.smoke else "nemotron-h-1b") + ("-moe" if args.moe else "")
    if args.moe and not args.smoke:
        shape = "nemotron-h-moe"
    episodes = args.episodes or (16 if args.smoke else 512)
    n_ref = args.ref_episodes or (4 if args.smoke else 32)
    max_tokens = args.max_tokens or (8192 if args.smoke else 32768)
    train_batch = min(args.train_batch, episodes // 2) if args.smoke else args.train_batch
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    out_file = args.out or os.path.join(
        out_dir, "bench_hybrid_gpu" + ("_moe" if args.moe else "") + ("_smoke" if args.smoke
                                                                       else "") + ".json")
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), *site,
                                          os.environ.get("PYTHONPATH", "")])}
    import subprocess

    import torch

    from treeflow.schemas import read_episodes

    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="treeflow-hybrid-bench-")
    data = os.path.join(work, "episodes.arrow")
    ckpt = os.path.join(work, shape)
    hf = make_checkpoint(shape, ckpt, args.device)
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", data, "--episodes",
                    str(episodes), "--group-size", "8", "--vocab-size",
                    str(min(SYNTH_VOCAB, SHAPES[shape]["vocab_size"])), "--max-turns",
                    "4" if args.smoke else "10", "--min-turns", "2" if args.smoke else "3",
                    "--seed", "0", *(["--routes-from", ckpt] if args.moe else [])],
                   check=True, env=env, capture_output=True)
    eps = read_episodes(data).to_pylist()
    result = {"shape": shape, "episodes": episodes, "ref_episodes": n_ref, "max_tokens": max_tokens,
              "device": args.device, "fidelity": {}, "replay": {}, "train": {}}

    def left() -> float | None:
        if args.budget_seconds is None:
            return None
        return args.budget_seconds - (time.perf_counter() - t_start)

    def save():
        result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        os.makedirs(os.path.dirname(out_file), exist_ok=True)
        with open(out_file, "w") as f:
            json.dump(result, f, indent=1)

    fidelity = not (args.no_fidelity or args.no_replay)
    if fidelity:
        t0 = time.perf_counter()
        ref = hf_logprobs(hf, eps, n_ref, torch.float32, replay=args.moe)
        if args.moe:
            own_ref = hf_logprobs(hf, eps, n_ref, torch.float32)
        result["fidelity"]["transformers_bf16_per_call"] = distance(
            hf_logprobs(hf, eps, n_ref, torch.bfloat16, replay=args.moe), ref)
        result["reference_seconds"] = round(time.perf_counter() - t0, 1)
    del hf
    import gc

    gc.collect()
    if torch.cuda.is_available():  # the CLI runs below are other processes: give them the GPU
        torch.cuda.empty_cache()
    print(json.dumps(result["fidelity"]), flush=True)
    common = ["--model", ckpt, "--device", args.device, "--dtype", "bfloat16",
              "--max-tokens", str(max_tokens), "--json", *(["--routing", "replay"] if args.moe
                                                            else []),
              *(["--ssm-kernel", args.ssm_kernel] if args.ssm_kernel else [])]
    runs = {"tree_exact_fork": ["--layout", "tree", "--ssm-fork", "exact"],
            "tree_chunk_fork": ["--layout", "tree", "--ssm-fork", "chunk"],
            "exact_layout": ["--layout", "exact"]}
    unknown = set(args.runs.split(",")) - set(runs)
    if unknown:
        ap.error(f"--runs: unknown {sorted(unknown)}; choose from {sorted(runs)}")
    runs = {k: v for k, v in runs.items() if k in args.runs.split(",")}
    runs = {k + ("" if p == "auto" else f"_{p}_products"):
            v + ([] if p == "auto" else ["--ssm-precision", p])
            for p in args.ssm_precisions.split(",") for k, v in runs.items()}
    for state in ([] if args.no_replay else args.state_dtypes.split(",")):
        for name, flags in runs.items():
            key = name if state == "float32" else f"{name}_bf16_states"
            path = os.path.join(work, f"{key}.arrow")
            if left() is not None and left() < 20:
                result["replay"][key] = "skipped (time budget)"
                continue
            r = cli(["replay", data, *flags, "--ssm-state-dtype", state, "-o", path, *common],
                    env, key, timeout=left())
            result["replay"][key] = r
            if "error" not in r and fidelity:
                result["fidelity"][key] = distance(read_logprobs(path, n_ref), ref)
            print(json.dumps({key: result["fidelity"].get(key), "steady_seconds":
                              r.get("steady_seconds")}), flush=True)
            save()
    if args.profile and left() is not None and left() < 60:
        result["profile"] = "skipped (time budget)"
    elif args.profile:
        result["profile"] = bin_profile.run(
            ckpt, data, os.path.join(work, "profile.json"), window=64, max_tokens=max_tokens,
            device=args.device, env=env, timeout=None if left() is None else left() - 20,
            ssm_kernel=args.ssm_kernel)
        print(json.dumps(result["profile"])[:1500], flush=True)
        save()
    if args.moe and fidelity and left() is not None and left() < 20:
        result["replay"]["exact_layout_recompute"] = "skipped (time budget)"
    elif args.moe and fidelity:  # the bf16 routers choose: distance from transformers' own
        # float32 routing
        key, path = "exact_layout_recompute", os.path.join(work, "recompute.arrow")
        r = cli(["replay", data, "--layout", "exact", "-o", path,
                 *[a for a in common if a not in ("--routing", "replay")], "--routing",
                 "recompute"], env, key, timeout=left())
        result["replay"][key] = r
        if "error" not in r:
            result["fidelity"][key] = distance(read_logprobs(path, n_ref), own_ref)
        print(json.dumps({key: result["fidelity"].get(key)}), flush=True)
        save()
    rep = result["replay"]
    for name in ("tree_exact_fork", "tree_chunk_fork"):
        if "steady_seconds" in rep.get(name, {}) and "steady_seconds" in rep.get("exact_layout",
                                                                                 {}):
            result[f"replay_speedup_{name}"] = round(
                rep["exact_layout"]["steady_seconds"] / rep[name]["steady_seconds"], 3)
    fid = result["fidelity"]
    if all(k in fid for k in ("tree_exact_fork", "tree_chunk_fork", "exact_layout")):
        gap = {k: abs(fid[k]["mean"] - fid["exact_layout"]["mean"])
               for k in ("tree_exact_fork", "tree_chunk_fork")}
        result["closer_to_exact_layout"] = min(gap, key=gap.get)
    for name, flags in ({} if args.no_train else runs).items():
        if left() is not None and left() < 20:
            result["train"][name] = "skipped (time budget)"
            continue
        r = cli(["replay", data, "--mode", "train", *flags, "--episodes-per-step", str(train_batch),
                 "--steps", str(args.train_steps), "--lr", "1e-6", *common], env, f"train {name}",
                timeout=left())
        result["train"][name] = r
        print(json.dumps({f"train_{name}": r.get("steady_seconds_per_step", r.get("error"))}),
              flush=True)
        save()
    tr = result["train"]
    for name in ("tree_exact_fork", "tree_chunk_fork"):
        a, b = tr.get("exact_layout"), tr.get(name)
        if isinstance(a, dict) and isinstance(b, dict) and a.get("steady_seconds_per_step") and b.get("steady_seconds_per_step"):
            result[f"train_speedup_{name}"] = round(
                a["steady_seconds_per_step"] / b["steady_seconds_per_step"], 3)
    save()
    print(json.dumps({k: v for k, v in result.items() if k not in ("replay", "train")}), flush=True)


if __name__ == "__main__":
    main()
