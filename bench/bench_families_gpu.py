"""Issue 51's GPU check of the new families: bf16 fidelity and tree vs exact speed through the CLI.

Two random-initialised checkpoints, written by transformers' own classes (`save_pretrained`,
weights stored in bfloat16 as released checkpoints are; transformers' float32 oracle below
runs the same bf16-representable weights in float32):

- `qwen3-1.7b`: Qwen3ForCausalLM at Qwen/Qwen3-1.7B's shape (hidden 2048, 28 layers, 16 heads,
  8 kv heads, head_dim 128, intermediate 6144, vocabulary 151936, tied embeddings; ~1.7B).
- `gdn-1.8b`: a Gated DeltaNet hybrid of the Qwen3.5 text class (Qwen3_5ForCausalLM): 24
  layers, every 4th gated full attention (16 heads, 2 kv heads, head_dim 256, a quarter
  rotary), the rest GDN (16 key and 16 value heads of 128, conv 4), dense SwiGLU MLPs of
  6144, vocabulary 151936, tied; ~1.8B. Not a released checkpoint's exact config: Qwen3-Next's
  layer geometry at a size one H100 runs in the time. Where the installed transformers has no
  Qwen3_5ForCausalLM, the same shape runs as Qwen3NextForCausalLM with every MLP dense
  (`mlp_only_layers`), and the JSON says so (`class`, `note`).

The float32 oracle and the bf16 bar are transformers' models as `from_pretrained` makes
them: parameters in the dtype, RoPE frequencies in float32 (`as_loaded`). An earlier
version cast the oracle with `model.to(bfloat16)`, which rounds those frequencies too,
and measured treeflow's Qwen3 15x further from it than transformers' bf16 (0.394 against
0.027 mean); treeflow was right and the oracle was not the checkpoint's model
(tests/models/reference/test_qwen3_bf16.py).

For each, on `treeflow synth` episodes in groups of 8 (`--episodes`, default 128 / 64):

- fidelity: `treeflow replay --dtype bfloat16 --layout tree` and `--layout exact`, each
  compared on the first `--ref-episodes` episodes with transformers' float32 model run call
  by call (the oracle), next to transformers' own bfloat16 per call on the same episodes:
  mean and max |logprob - float32 oracle| over the sampled tokens. The issue's bar: the tree's
  distance no larger than transformers' own bf16 distance.
- speed: the same two replays' `process_seconds` (the command as a user runs it: imports,
  load, compile, run, write) and `steady_seconds` (the CLI's split), tree over exact.

The GDN layers run treeflow's torch chunked delta rule (models/ssm/gdn.py: the intra-chunk
products batched over a level's chunks, one step per chunk position of its longest segment;
no Triton path) on CUDA as on CPU; `--ssm-kernel auto` runs it (Mamba-2's fused scan is not
a GDN kernel). Its cost is launch-bound: counted from the segment plans of 64 synthetic
episodes in 32k-token bins (CPU), the tree's 8 bins take 1,059 sequential chunk steps per GDN
layer in all and the exact layout's 28 bins 1,757, ~15 small kernels a step: some 19k / 32k
steps over 18 GDN layers, seconds on a GPU, so 64 episodes fit the time; the tree's speedup
over exact is smaller here than for attention layers (the steps follow branching depth and
the longest segment, not tokens). transformers' oracle uses flash-linear-attention where
installed, else its own torch_chunk_gated_delta_rule (`transformers_gdn_kernel` in the
JSON). Every part is skipped with a reason once `--budget-seconds` is spent, and a failed
command or shape is recorded (its `error`), not raised, so one family's failure leaves the
other's numbers.

    PYTHONUNBUFFERED=1 python3 bench/bench_families_gpu.py            # one H100, ~5 min
    python3 bench/bench_families_gpu.py --shapes qwen3-1.7b --tunings auto,plain  # fast vs plain
    python3 bench/bench_families_gpu.py --tiny --device cpu           # logic check, tiny sizes

Prints JSON lines as it goes; the result lands in $OUT/bench_families_gpu.json (or
bench/results/, or a temporary directory with --tiny), or --out.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_cli_gpu import cli  # noqa: E402  (runs `python -m treeflow.cli ...`, parses --json)
from bench_hybrid_gpu import distance, hf_logprobs, read_logprobs  # noqa: E402
from tests.weights import as_loaded  # noqa: E402

_GDN_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 6
SHAPES = {  # transformers config class name -> kwargs; "episodes": default episodes
    "qwen3-1.7b": dict(cls="Qwen3ForCausalLM", episodes=128, config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True)),
    "gdn-1.8b": dict(cls="Qwen3_5ForCausalLM", episodes=64, config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=_GDN_TYPES, tie_word_embeddings=True)),
    "qwen3-tiny": dict(cls="Qwen3ForCausalLM", episodes=8, config=dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "gdn-tiny": dict(cls="Qwen3_5ForCausalLM", episodes=8, config=dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=_GDN_TYPES[:4], tie_word_embeddings=True)),
}
CONFIGS = {"Qwen3ForCausalLM": "Qwen3Config", "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
           "Qwen3NextForCausalLM": "Qwen3NextConfig"}
SYNTH_VOCAB = 32000


def model_class(shape: str) -> tuple[str, dict, str | None]:
    """(transformers class name, config kwargs, note): Qwen3.5 falls back to Qwen3-Next (dense
    MLPs everywhere) where this transformers lacks it."""
    import transformers

    spec = SHAPES[shape]
    name, config = spec["cls"], dict(spec["config"])
    if hasattr(transformers, name):
        return name, config, None
    if name != "Qwen3_5ForCausalLM" or not hasattr(transformers, "Qwen3NextForCausalLM"):
        raise LookupError(f"transformers {transformers.__version__} has no {name}")
    layers = config["num_hidden_layers"]
    config.update(mlp_only_layers=list(range(layers)), num_experts=0)
    return "Qwen3NextForCausalLM", config, (
        f"transformers {transformers.__version__} has no Qwen3_5ForCausalLM: the same shape "
        "ran as Qwen3NextForCausalLM with every MLP dense (mlp_only_layers)")


def make_checkpoint(name: str, config: dict, path: str, device: str):
    """transformers' own class with its own random init, saved in bfloat16; returned in float32
    (the bf16-representable weights the CLI reads, RoPE frequencies float32 as
    `from_pretrained` makes them) for the oracle."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, CONFIGS[name])(**config)
    cfg.architectures = [name]
    with torch.device(device):
        model = getattr(transformers, name)(cfg)
    as_loaded(model, torch.bfloat16).save_pretrained(path)
    # not model.to(): it would round the RoPE frequencies of the oracle too (see as_loaded)
    return as_loaded(model, torch.float32).eval()


def gdn_kernel_of_transformers() -> str:
    return ("flash-linear-attention (fla)" if importlib.util.find_spec("fla") is not None
            else "torch_chunk_gated_delta_rule (torch)")


def run_shape(shape: str, args, env: dict, work: str, left, save, result: dict) -> None:
    import torch

    from treeflow.schemas import read_episodes

    res = result["shapes"].setdefault(shape, {})
    try:
        name, config, note = model_class(shape)
    except LookupError as e:
        res["skipped"] = str(e)
        print(json.dumps({shape: res}), flush=True)
        return
    res.update({"class": name, **({"note": note} if note else {})})
    episodes = args.episodes or SHAPES[shape]["episodes"]
    n_ref = min(args.ref_episodes, episodes)
    res.update(episodes=episodes, ref_episodes=n_ref)
    t0 = time.perf_counter()
    ckpt, data = os.path.join(work, shape), os.path.join(work, f"{shape}-episodes.arrow")
    hf = make_checkpoint(name, config, ckpt, args.device)
    res["parameters"] = sum(p.numel() for p in hf.parameters())
    res["checkpoint_seconds"] = round(time.perf_counter() - t0, 1)
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", data, "--episodes",
                    str(episodes), "--group-size", "8", "--vocab-size",
                    str(min(SYNTH_VOCAB, config["vocab_size"])), "--max-turns",
                    str(args.max_turns), "--min-turns", "2", "--seed", "0"],
                   check=True, env=env, capture_output=True)
    eps = read_episodes(data).to_pylist()
    fid = res["fidelity"] = {}
    t0 = time.perf_counter()
    ref = hf_logprobs(hf, eps, n_ref, torch.float32)
    fid["transformers_bf16_per_call"] = distance(hf_logprobs(hf, eps, n_ref, torch.bfloat16), ref)
    res["reference_seconds"] = round(time.perf_counter() - t0, 1)
    del hf
    gc.collect()
    if torch.cuda.is_available():  # the CLI runs are other processes: give them the GPU
        torch.cuda.empty_cache()
    print(json.dumps({shape: fid}), flush=True)
    save()
    common = ["--model", ckpt, "--device", args.device, "--dtype", "bfloat16", "--max-tokens",
              str(args.max_tokens), "--json"]
    for tuning, layout in [(t, layout) for t in args.tunings.split(",")
                           for layout in ("tree", "exact")]:
        tail = "" if tuning == "auto" else f"_{tuning}"  # auto keeps the keys it always had
        key = f"replay_{layout}{tail}"
        if left() < 20:
            res[key] = "skipped (time budget)"
            continue
        path = os.path.join(work, f"{shape}-{layout}{tail}.arrow")
        r = cli(["replay", data, "--layout", layout, "--tuning", tuning, "-o", path, *common],
                env, f"{shape} {key}", timeout=left())
        res[key] = r
        if "error" not in r:
            fid[("tree_bf16" if layout == "tree" else "exact_layout_bf16") + tail] = distance(
                read_logprobs(path, n_ref), ref)
        print(json.dumps({shape: {key: {k: r.get(k) for k in (
            "process_seconds", "steady_seconds", "compile_seconds", "error")}}}), flush=True)
        save()
    tree, exact = res.get("replay_tree"), res.get("replay_exact")
    if isinstance(tree, dict) and isinstance(exact, dict) and "error" not in tree \
            and "error" not in exact:
        res["speedup_steady"] = round(exact["steady_seconds"] / tree["steady_seconds"], 3)
        res["speedup_process"] = round(exact["process_seconds"] / tree["process_seconds"], 3)
    own = fid["transformers_bf16_per_call"]
    for name in [k for k in fid if k.startswith("tree_bf16")]:  # one per --tunings value
        res[f"{name}_over_transformers_bf16"] = {  # <= 1: as close as transformers' own
            k: round(fid[name][k] / own[k], 3) if own[k] else None for k in ("mean", "max")}
    save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and data (logic check)")
    ap.add_argument("--shapes", default=None,
                    help=f"comma-separated, of {sorted(SHAPES)} (default: the two 1-2B shapes; "
                         "--tiny: the two tiny ones)")
    ap.add_argument("--episodes", type=int, default=None,
                    help="episodes per shape (default: qwen3 128, gdn 64; tiny 8)")
    ap.add_argument("--ref-episodes", type=int, default=8,
                    help="episodes compared with transformers float32 per call")
    ap.add_argument("--max-turns", type=int, default=10, help="treeflow synth --max-turns")
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--tunings", default="auto",
                    help="comma-separated --tuning values to replay with, each tree and exact "
                         "(e.g. auto,plain: the compiled layers next to the plain path)")
    ap.add_argument("--budget-seconds", type=float, default=290,
                    help="skip the CLI runs left once this is spent (a device call is capped)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = (args.shapes or ("qwen3-tiny,gdn-tiny" if args.tiny else "qwen3-1.7b,gdn-1.8b")
              ).split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
    if args.tiny:
        args.max_turns = min(args.max_turns, 4)
        args.ref_episodes = min(args.ref_episodes, 2)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_families_gpu.py: --device cuda but CUDA is not available here; run it on "
                 "a GPU machine, or check the logic with --tiny --device cpu")
    out_dir = os.environ.get("OUT") or (tempfile.mkdtemp(prefix="treeflow-families-tiny-")
                                        if args.tiny else os.path.join(HERE, "results"))
    out_file = args.out or os.path.join(out_dir, "bench_families_gpu.json")
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), *site,
                                          os.environ.get("PYTHONPATH", "")])}
    import transformers

    t_start = time.perf_counter()
    result = {"settings": {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "max_tokens": args.max_tokens, "tunings": args.tunings, "max_turns": args.max_turns,
        "group_size": 8,
        "dtype": "bfloat16", "budget_seconds": args.budget_seconds,
        "treeflow_gdn_kernel": "torch chunked delta rule (models/ssm/gdn.py)",
        "transformers_gdn_kernel": gdn_kernel_of_transformers()}, "shapes": {}}

    def left() -> float:
        return args.budget_seconds - (time.perf_counter() - t_start)

    def save() -> None:
        result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
        with open(out_file, "w") as f:
            json.dump(result, f, indent=1)

    with tempfile.TemporaryDirectory(prefix="treeflow-families-bench-") as work:
        for shape in shapes:
            if left() < 60:
                result["shapes"][shape] = {"skipped": "time budget"}
                continue
            try:
                run_shape(shape, args, env, work, left, save, result)
            except Exception as e:  # noqa: BLE001 -- recorded: the next shape still runs
                import traceback

                traceback.print_exc()
                result["shapes"].setdefault(shape, {})["error"] = f"{type(e).__name__}: {e}"[:2000]
                save()
    save()
    print(json.dumps({"out": out_file, "wall_seconds": result["wall_seconds"]}), flush=True)


if __name__ == "__main__":
    main()
