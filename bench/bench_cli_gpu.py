"""CLI-level GPU benchmark: `treeflow replay` tree vs exact, as a user runs it, next to the kernel bench.

For each model shape (random-weight checkpoints of Qwen2-0.5B and
Llama-3.2-1B shape, written as Hugging Face directories), on 512 synthetic
episodes in groups of 8 (`treeflow synth`):

- `treeflow replay --layout exact|tree --device cuda --dtype bfloat16
  --max-tokens 32768 --json`: wall time, split by the CLI into
  `startup_seconds` (model-code imports, CUDA initialisation, model load),
  `compile_seconds` (warm-up: flex and varlen kernels compiled on dummy bins)
  and `steady_seconds` (the rest: reading, preparing, running, reassembling
  and writing every window, pipeline fill and drain included). The speedups
  use steady seconds (and wall seconds, for reference);
- GPU busy, two ways. `device_busy` (every run): CUDA events recorded
  around every bin's work, summed (`device_seconds`), over steady seconds.
  `kernel_busy` (`--profile-busy`, one more run per layout through
  bench/profiled_cli.py): the union of all kernel/copy/memset intervals that
  CUPTI traced (torch.profiler, CUDA activity only) from the end of warm-up
  to the end of the run, over that span's wall time -- this one cannot count
  a gap inside a bin as busy;
- plain transformers (bench/bench_transformers_padded.py, a process of its own): every
  exact call its own sequence, sorted by length, right-padded batches of at most
  `--max-tokens` padded tokens, `AutoModelForCausalLM` with SDPA; its process and steady
  seconds over the tree's (`tree_over_transformers_*`) and its logprobs' distance to the
  tree's (both bf16);
- `treeflow replay --mode train --episodes-per-step 64 --steps S` per layout:
  steady-state seconds per optimizer step (first step excluded);
- `--backends reference,megatron`: also the megatron-core backend through the same
  command (`--backend megatron --tensor-parallel T` for each T of `--tp`, tree
  layout, replay and train), its steady tokens/s over the reference backend's
  (`megatron_over_reference`), and its logprobs' distance to the reference
  backend's on the same episodes (both bf16);
- `--tunings plain,fast,lean`: also the reference backend's `--tuning` presets through
  the same commands (tree layout), their steady speed over plain's and peak memory;
- `bench/bench_gpu.py --shape ...` on the same episodes (same synth seed and
  vocabulary): the model's forward alone, for the ratio
  CLI speedup / kernel speedup.

Every run is a subprocess (the CLI a user runs, imports included), printed
as it goes; the JSON lands in $OUT/bench_cli_gpu.json (or bench/results).

    PYTHONUNBUFFERED=1 python bench/bench_cli_gpu.py             # one H200, < 9 min
    PYTHONUNBUFFERED=1 python bench/bench_cli_gpu.py --profile-busy --no-train --no-kernel-bench \
        --out bench_cli_gpu_busy.json                             # the kernel-trace check, ~3 min
    PYTHONUNBUFFERED=1 python bench/bench_cli_gpu.py --shapes llama-3.2-1b --layouts tree \
        --backends reference,megatron --tp 1,2 --no-kernel-bench --out bench_cli_megatron.json
                                                                  # two H200s, ~8 min
    python bench/bench_cli_gpu.py --smoke --device cpu            # logic check, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

SHAPES = {  # Hugging Face config.json fields of the public models' shapes (random weights)
    "qwen2-0.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                   "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                   "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "llama-3.2-1b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
    "smoke": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
}
SYNTH_VOCAB = 32000  # token ids of the synthetic episodes (below every real shape's vocabulary)


def make_checkpoint(shape: str, path: str, device: str) -> None:
    """Random normal(0, 0.02) weights of the shape, saved as a HF checkpoint (bf16 on GPU).

    Built in a child process: a parent that touched CUDA keeps its context and cached
    blocks (6.5 GiB for Llama-3.2-1B) on the card for the whole bench, and the runs it
    measures would find that much less memory."""
    code = ("import sys, torch; sys.path.insert(0, %r)\n"
            "from treeflow.models import ModelConfig, save_model\n"
            "from treeflow.models.checkpoint import seeded_decoder\n"
            "from bench_cli_gpu import SHAPES\n"
            "dtype = torch.bfloat16 if %r == 'cuda' else torch.float32\n"
            "save_model(seeded_decoder(ModelConfig.from_hf_dict(SHAPES[%r]), device=%r, "
            "dtype=dtype), %r)\n" % (ROOT, device, shape, device, path))
    paths = [HERE, ROOT, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def _no_core_files() -> None:
    """In the child before exec: SIGABRT (the timeout's stack dump) writes no core file of a
    process holding a GPU context."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


# the child: faulthandler prints every thread's stack on SIGUSR1 (cli's quiet-run watch), then
# the CLI (or a script) runs as `python -m` / `python script` would run it
_LAUNCH = ("import faulthandler, os, runpy, signal, sys; "
           "faulthandler.register(signal.SIGUSR1, all_threads=True); "
           "target = sys.argv.pop(1); script = target.endswith('.py'); "
           "sys.argv[0] = target if script else sys.argv[0]; "
           "script and sys.path.insert(0, os.path.dirname(os.path.abspath(target))); "
           "runpy.run_path(target, run_name='__main__') if script "
           "else runpy.run_module(target, run_name='__main__', alter_sys=True)")


def _where(pid: int) -> str:
    """Where a quiet process is, read from outside (the SIGUSR1 stacks came out empty on two
    fresh GPU machines): its threads by kernel wait channel, its child processes (inductor's
    compile workers), and the GPUs' utilization."""
    import collections
    import glob

    waits = collections.Counter()
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/wchan") as f:
                waits[f.read().strip() or "running"] += 1
        except OSError:
            continue
    children = 0  # forked by any of its threads (the ahead-of-time builds' threads run g++)
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/children") as f:
                children += len(f.read().split())
        except OSError:
            continue
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        gpu = []
    return (f"threads by wait {dict(waits.most_common(6))}, child processes {children}, GPU "
            f"utilization {' '.join(gpu) or '?'}")


def cli(args: list[str], env: dict, log: str, script: str | None = None,
        stderr_with: str | None = None, timeout: float | None = None,
        quiet_stacks: float | None = 60.0) -> dict:
    """Run `python -m treeflow.cli ...` (or `script ...`); its --json object and process time
    (and, with `stderr_with`, its stderr lines holding that text as `stderr_lines`).

    The child's stderr is echoed as it comes, each line led by `[log +seconds]`, so a device
    call's log shows where a run spent its time. Past `timeout` seconds the child gets SIGABRT
    (faulthandler, on in the child, prints every thread's Python stack), then SIGKILL; the
    result is an error holding the stderr tail with those stacks. A child that writes nothing
    to stderr for `quiet_stacks` seconds gets SIGUSR1 (its stacks, printed; it runs on), again
    after each further quiet spell: a run slow for reasons no log line names (a first compile
    on a fresh machine) shows where it is while it still can finish. quiet_stacks=None: no
    watch."""
    t0 = time.perf_counter()
    run = ["-c", _LAUNCH, script or "treeflow.cli"]
    proc = subprocess.Popen([sys.executable, *run, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**env, "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=_no_core_files)
    lines: list[str] = []
    chunks: list[str] = []
    last = [time.perf_counter()]

    def echo() -> None:
        for line in proc.stderr:
            lines.append(line)
            last[0] = time.perf_counter()
            print(f"[{log} +{time.perf_counter() - t0:.0f}s] {line}", end="", file=sys.stderr,
                  flush=True)

    readers = [threading.Thread(target=echo, daemon=True),
               threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)]
    for reader in readers:
        reader.start()
    timed_out = False
    try:
        while True:
            now = time.perf_counter()
            waits = [] if quiet_stacks is None else [max(0.5, quiet_stacks - (now - last[0]))]
            if timeout is not None:
                waits.append(max(0.0, timeout - (now - t0)))
            try:
                proc.wait(timeout=min(waits) if waits else None)
                break
            except subprocess.TimeoutExpired:
                if timeout is not None and time.perf_counter() - t0 >= timeout:
                    raise
                if quiet_stacks is not None and time.perf_counter() - last[0] >= quiet_stacks:
                    last[0] = time.perf_counter()
                    print(f"[{log} +{last[0] - t0:.0f}s] quiet for {quiet_stacks:.0f} s: its "
                          f"stacks (SIGUSR1); {_where(proc.pid)}", file=sys.stderr, flush=True)
                    proc.send_signal(signal.SIGUSR1)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for reader in readers:
        reader.join(timeout=15)
    stdout = "".join(chunks)
    wall = time.perf_counter() - t0
    stderr = "".join(lines)
    if timed_out or proc.returncode != 0 or not stdout.strip():
        why = (f"timed out after {timeout:.0f} s; " if timed_out else "" if proc.returncode
               else "exited 0 with no --json line (a process holding its stdout?); ")
        print(f"  FAILED ({log}): {why}{stderr[-2000:]}", flush=True)
        return {"error": why + stderr[-6000 if timed_out else -2000:],
                "process_seconds": round(wall, 2)}
    out = json.loads(stdout.strip().splitlines()[-1])
    out["process_seconds"] = round(wall, 2)
    if stderr_with is not None:
        out["stderr_lines"] = [line for line in stderr.splitlines() if stderr_with in line]
    return out


def megatron_runs(res, shape, data, work, common, args, env, left, save, elapsed) -> None:
    """The megatron backend through the same command, tree layout, at each --tp size."""
    import numpy as np
    import pyarrow as pa

    def logprobs(path):
        col = pa.ipc.open_file(path).read_all().column("logprobs").combine_chunks()
        return np.asarray(col.flatten().flatten(), dtype=np.float64)

    for tp in (int(x) for x in args.tp.split(",")):
        key = f"megatron_tp{tp}"
        if tp > 1 and args.device == "cuda":
            import torch

            if torch.cuda.device_count() < tp:
                res[key] = f"skipped: {torch.cuda.device_count()} GPU(s) visible"
                continue
        mc = ["--backend", "megatron", "--tensor-parallel", str(tp), "--layout", "tree"]
        if left() < 30:
            res[f"{key}_replay_tree"] = "skipped (time budget)"
        else:
            print(f"[{elapsed():.0f}s] {shape}: replay --backend megatron --tensor-parallel {tp}",
                  flush=True)
            path = os.path.join(work, f"{shape}-{key}.arrow")
            r = cli(["replay", data, "--episodes-per-step", str(args.window), "-o", path, *mc, *common], env,
                    f"{key} replay")
            res[f"{key}_replay_tree"] = r
            ref = res.get("replay_tree")
            if "error" not in r and isinstance(ref, dict) and "error" not in ref:
                res[f"{key}_over_reference_replay"] = round(
                    r["exact_tokens_per_s"] / ref["exact_tokens_per_s"], 3)
                d = np.abs(logprobs(path) - logprobs(os.path.join(work, f"{shape}-tree.arrow")))
                res[f"{key}_logprob_diff_vs_reference"] = {"mean": float(d.mean()),
                                                           "max": float(d.max())}
            print(f"  {json.dumps(r)[:400]}", flush=True)
            save()
        if args.no_train:
            continue
        if left() < 30:
            res[f"{key}_train_tree"] = "skipped (time budget)"
            continue
        print(f"[{elapsed():.0f}s] {shape}: train --backend megatron --tensor-parallel {tp}",
              flush=True)
        r = cli(["replay", data, "--mode", "train", "--episodes-per-step", str(args.train_batch),
                 "--steps", str(args.train_steps), "--lr", "1e-6", *mc, *common], env,
                f"{key} train")
        res[f"{key}_train_tree"] = r
        ref = res.get("train_tree")
        if (isinstance(ref, dict) and ref.get("steady_seconds_per_step")
                and r.get("steady_seconds_per_step")):
            res[f"{key}_over_reference_train_step"] = round(
                ref["steady_seconds_per_step"] / r["steady_seconds_per_step"], 3)
        print(f"  {json.dumps(r)[:400]}", flush=True)
        save()


def transformers_run(res, shape, data, work, ckpt, dtype, args, env, left, save, elapsed) -> None:
    """Plain transformers, every call its own sequence in padded batches, same budget."""
    import numpy as np
    import pyarrow as pa

    if left() < 30:
        res["replay_transformers"] = "skipped (time budget)"
        return
    print(f"[{elapsed():.0f}s] {shape}: plain transformers, padded batches", flush=True)
    path = os.path.join(work, f"{shape}-transformers.arrow")
    r = cli([data, "--model", ckpt, "--device", args.device, "--dtype", dtype, "--max-tokens",
             str(args.max_tokens), "-o", path], env, "transformers",
            script=os.path.join(HERE, "bench_transformers_padded.py"))
    res["replay_transformers"] = r
    tree = res.get("replay_tree")
    if "error" not in r and isinstance(tree, dict) and "error" not in tree:
        res["tree_over_transformers_process"] = round(
            r["process_seconds"] / tree["process_seconds"], 3)
        res["tree_over_transformers_steady"] = round(
            r["steady_seconds"] / tree["steady_seconds"], 3)

        def by_id(p):
            t = pa.ipc.open_file(p).read_all()
            ids = t.column("episode_id").to_pylist()
            col = t.column("logprobs").combine_chunks()
            while pa.types.is_list(col.type.value_type):  # treeflow's: per call, per token
                inner = col.values.offsets.to_numpy()[col.offsets.to_numpy()]
                col = pa.ListArray.from_arrays(pa.array(inner), col.values.values)
            return dict(zip(ids, col.to_pylist()))

        hf, tf = by_id(path), by_id(os.path.join(work, f"{shape}-tree.arrow"))
        d = np.abs(np.concatenate([np.asarray(hf[k], np.float64) - np.asarray(tf[k], np.float64)
                                   for k in hf]))
        res["tree_logprob_diff_vs_transformers"] = {"mean": float(d.mean()),
                                                    "max": float(d.max())}
    print(f"  {json.dumps(r)[:400]}", flush=True)
    save()


def tuning_runs(res, shape, data, work, common, args, env, left, save, elapsed) -> None:
    """The reference backend's --tuning presets through the same commands, tree layout."""
    for name in (t for t in args.tunings.split(",") if t != "plain"):
        for mode in ("replay",) + (() if args.no_train else ("train",)):
            key = f"tuning_{name}_{mode}_tree"
            if left() < 30:
                res[key] = "skipped (time budget)"
                continue
            print(f"[{elapsed():.0f}s] {shape}: {mode} --tuning {name}", flush=True)
            extra = (["--mode", "train", "--episodes-per-step", str(args.train_batch), "--steps",
                      str(args.train_steps), "--lr", "1e-6"] if mode == "train" else
                     ["--episodes-per-step", str(args.window), "-o",
                      os.path.join(work, f"{shape}-tuning-{name}.arrow")])
            r = cli(["replay", data, "--layout", "tree", "--tuning", name, *extra, *common], env,
                    key)
            res[key] = r
            plain = res.get(f"{mode}_tree")
            if mode == "replay" and isinstance(plain, dict) and "error" not in plain \
                    and "error" not in r:
                res[f"tuning_{name}_over_plain_replay"] = round(
                    r["exact_tokens_per_s"] / plain["exact_tokens_per_s"], 3)
            if mode == "train" and isinstance(plain, dict) and plain.get(
                    "steady_seconds_per_step") and r.get("steady_seconds_per_step"):
                res[f"tuning_{name}_over_plain_train_step"] = round(
                    plain["steady_seconds_per_step"] / r["steady_seconds_per_step"], 3)
            print(f"  {json.dumps(r)[:400]}", flush=True)
            save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2-0.5b,llama-3.2-1b")
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=10, help="treeflow synth --max-turns")
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-seconds", type=float, default=500,
                    help="skip what is left after this much time (the results so far are kept)")
    ap.add_argument("--layouts", default="exact,tree", help="reference backend layouts")
    ap.add_argument("--backends", default="reference", help="reference[,megatron]")
    ap.add_argument("--tp", default="1,2", help="megatron --tensor-parallel sizes to run")
    ap.add_argument("--tunings", default="plain",
                    help="reference --tuning presets to run on the tree layout besides plain")
    ap.add_argument("--no-kernel-bench", action="store_true")
    ap.add_argument("--no-transformers", action="store_true",
                    help="skip the plain-transformers padded-batch baseline")
    ap.add_argument("--no-train", action="store_true", help="skip the --mode train runs")
    ap.add_argument("--profile-busy", action="store_true",
                    help="one more replay per layout with CUDA kernels traced (kernel_busy)")
    ap.add_argument("--out", default=None, help="JSON file name (default bench_cli_gpu.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and data (logic check)")
    args = ap.parse_args()
    layouts = tuple(args.layouts.split(","))
    backends = tuple(args.backends.split(","))
    unknown = set(backends) - {"reference", "megatron"}
    if unknown or "reference" not in backends:
        ap.error(f"--backends {args.backends}: give reference or reference,megatron")
    if args.smoke:
        args.shapes, args.episodes, args.group_size, args.max_turns = "smoke", 8, 2, 3
        args.max_tokens, args.window, args.train_batch, args.train_steps = 8192, 4, 4, 2
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    t_start = time.perf_counter()
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    out_file = os.path.join(out_dir, args.out or ("bench_cli_gpu.json" if not args.smoke else
                                                  "bench_cli_gpu_smoke.json"))
    # the children import this checkout and this interpreter's packages, however it was started
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, *site, os.environ.get("PYTHONPATH", "")])}
    result: dict = {"settings": vars(args), "shapes": {}, "measures": {
        "steady_seconds": "wall - startup_seconds (imports, CUDA init, model load) - "
                          "compile_seconds (warm-up); fill, drain, reading and writing included",
        "device_busy": "sum over bins of CUDA-event time around each bin's work / steady_seconds",
        "kernel_busy": "union of CUPTI-traced kernel/memcpy/memset intervals from the end of "
                       "warm-up to the end of the run / that span's wall time (separate, traced run)",
        "cli_over_kernel_speedup": "replay_speedup_steady / kernel_forward_speedup"}}
    work = tempfile.mkdtemp(prefix="treeflow-bench-")
    data = os.path.join(work, "episodes.arrow")
    print(f"synth {args.episodes} episodes (groups of {args.group_size})", flush=True)
    subprocess.run([sys.executable, "-m", "treeflow.cli", "synth", "-o", data, "--episodes",
                    str(args.episodes), "--group-size", str(args.group_size), "--vocab-size",
                    str(SHAPES["smoke"]["vocab_size"] if args.smoke else SYNTH_VOCAB),
                    "--min-turns", str(min(3, args.max_turns)), "--max-turns", str(args.max_turns),
                    "--seed", "0"], check=True, env=env, capture_output=True)

    def left() -> float:
        return args.budget_seconds - (time.perf_counter() - t_start)

    def save():
        result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        with open(out_file, "w") as f:
            json.dump(result, f, indent=1)

    for shape in args.shapes.split(","):
        res = result["shapes"][shape] = {}
        ckpt = os.path.join(work, shape)
        t0 = time.perf_counter()
        make_checkpoint(shape, ckpt, args.device)
        res["checkpoint_seconds"] = round(time.perf_counter() - t0, 1)
        # the plain path unless a run names its preset (--tuning auto picks fast on Hopper)
        common = ["--model", ckpt, "--device", args.device, "--dtype", dtype,
                  "--max-tokens", str(args.max_tokens), "--json", "--tuning", "plain"]
        for layout in layouts:
            if left() < 30:
                res[f"replay_{layout}"] = "skipped (time budget)"
                continue
            print(f"[{time.perf_counter() - t_start:.0f}s] {shape}: replay --layout {layout}",
                  flush=True)
            r = cli(["replay", data, "--layout", layout, "--episodes-per-step", str(args.window),
                     "-o", os.path.join(work, f"{shape}-{layout}.arrow"), *common], env, layout)
            res[f"replay_{layout}"] = r
            print(f"  {json.dumps(r)[:400]}", flush=True)
            save()
        if not args.no_transformers:
            transformers_run(res, shape, data, work, ckpt, dtype, args, env, left, save,
                             lambda: time.perf_counter() - t_start)
        ex, tr = res.get("replay_exact"), res.get("replay_tree")
        if isinstance(ex, dict) and isinstance(tr, dict) and "error" not in ex and "error" not in tr:
            res["replay_speedup_steady"] = round(ex["steady_seconds"] / tr["steady_seconds"], 3)
            res["replay_speedup_wall"] = round(ex["wall_seconds"] / tr["wall_seconds"], 3)
            res["device_busy"] = {"exact": ex.get("device_busy"), "tree": tr.get("device_busy")}
        for layout in ("exact", "tree") if args.profile_busy else ():
            if left() < 30:
                res[f"replay_{layout}_traced"] = "skipped (time budget)"
                continue
            print(f"[{time.perf_counter() - t_start:.0f}s] {shape}: replay --layout {layout} "
                  "(kernels traced)", flush=True)
            r = cli(["replay", data, "--layout", layout, "--episodes-per-step", str(args.window),
                     "-o", os.path.join(work, f"{shape}-{layout}-traced.arrow"), *common], env,
                    f"{layout} traced", script=os.path.join(HERE, "profiled_cli.py"))
            res[f"replay_{layout}_traced"] = r
            if "kernel_busy" in r:
                res.setdefault("kernel_busy", {})[layout] = r["kernel_busy"]
            print(f"  {json.dumps(r)[:400]}", flush=True)
            save()
        for layout in layouts if not args.no_train else ():
            if left() < 30:
                res[f"train_{layout}"] = "skipped (time budget)"
                continue
            print(f"[{time.perf_counter() - t_start:.0f}s] {shape}: train --layout {layout}",
                  flush=True)
            r = cli(["replay", data, "--mode", "train", "--layout", layout, "--episodes-per-step",
                     str(args.train_batch), "--steps", str(args.train_steps), "--lr", "1e-6",
                     *common], env, f"train {layout}")
            res[f"train_{layout}"] = r
            print(f"  {json.dumps(r)[:400]}", flush=True)
            save()
        tuning_runs(res, shape, data, work, common, args, env, left, save,
                    lambda: time.perf_counter() - t_start)
        if "megatron" in backends:
            megatron_runs(res, shape, data, work, common, args, env, left, save,
                          lambda: time.perf_counter() - t_start)
        ex, tr = res.get("train_exact"), res.get("train_tree")
        if (isinstance(ex, dict) and isinstance(tr, dict) and ex.get("steady_seconds_per_step")
                and tr.get("steady_seconds_per_step")):
            res["train_step_speedup_steady"] = round(
                ex["steady_seconds_per_step"] / tr["steady_seconds_per_step"], 3)
        if not args.no_kernel_bench and args.device == "cuda" and left() > 60:
            print(f"[{time.perf_counter() - t_start:.0f}s] {shape}: bench_gpu.py (forward only)",
                  flush=True)
            proc = subprocess.run(
                [sys.executable, os.path.join(HERE, "bench_gpu.py"), "--shape", shape,
                 "--episodes", str(args.episodes), "--group-size", str(args.group_size),
                 "--vocab-size", str(SYNTH_VOCAB), "--max-tokens", str(args.max_tokens),
                 "--layouts", "exact,tree", "--no-train", "--repeats", "1"],
                capture_output=True, text=True, env={**env, "OUT": work})
            if proc.returncode == 0:
                kb = json.loads(open(os.path.join(work, "bench_gpu.json")).read())
                fwd = {k: v.get("forward", {}).get("median_s") for k, v in kb["layouts"].items()}
                res["kernel_forward_seconds"] = fwd
                if fwd.get("exact") and fwd.get("tree"):
                    res["kernel_forward_speedup"] = round(fwd["exact"] / fwd["tree"], 3)
                    if "replay_speedup_steady" in res:
                        res["cli_over_kernel_speedup"] = round(
                            res["replay_speedup_steady"] / res["kernel_forward_speedup"], 3)
            else:
                res["kernel_bench_error"] = proc.stderr[-2000:]
            save()
        print(f"[{time.perf_counter() - t_start:.0f}s] {shape}: "
              + json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}), flush=True)
    save()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
