"""The bf16 floor of the gate's generation KL: where each side's error against float32 comes from.

The gate's generation KL compares two bf16 computations of the same sampled tokens: the
sampler's (treeflow's reference backend, pure bf16 weights, each step one causal chain per
context) and the trainer's (float32 weights under bf16 autocast, the calls as one tree). With
d = trainer - sampler = (trainer - fp32) - (sampler - fp32), each side's distance to float32
transformers (call by call, the captured routes forced) is set beside transformers' own bf16
distance on the same tokens:

  hf_bf16      transformers, weights cast to bf16 (what a bf16 sampler such as vLLM computes)
  hf_autocast  transformers, float32 weights under bf16 autocast (the trainer's precision)
  sampler      the episodes' generation_logprobs (treeflow's sampler, pure bf16)
  trainer      treeflow's bf16 trainer (mixed precision, the tree), as the gate scores them
  tf_float32   treeflow float32 (the tree): its distance is treeflow's exactness, ~1e-6

Each as the gate's k3 estimator mean(expm1(d) - d) over the sampled tokens, with d against
float32 transformers; `gen_kl` is trainer vs sampler. If treeflow adds no error of its own,
sampler ~ hf_bf16 and trainer ~ hf_autocast. The trade-off: transformers runs call by call
(every call's whole context again), so the floor is measured on a share of the episodes
(`max_episodes`), which keeps it to seconds beside the gate on a GPU.

    python bench/gate_kl_floor.py --smoke                       # CPU, small Nemotron-H MoE
    python bench/gate_kl_floor.py --model DIR --episodes F.arrow --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "models"))  # forced_routes


def k3(got: np.ndarray, ref: np.ndarray) -> float:
    """The gate's estimator (programs/fidelity.py) of got against ref: mean(expm1(d) - d)."""
    d = np.asarray(got, np.float64) - np.asarray(ref, np.float64)
    return float(np.mean(np.expm1(d) - d))


def hf_sampled_logprobs(model, rows: list[dict], autocast: bool) -> np.ndarray:
    """transformers call by call: the sampled tokens' logprobs (log_softmax in float32), each
    call's captured routes forced into its routers (what the trainer replays)."""
    import contextlib

    import torch
    from hybrid_moe_helpers import forced_routes

    out = []
    dev = next(model.parameters()).device
    for row in rows:
        for call in row["calls"]:
            ids = torch.tensor([call["token_ids"]], device=dev)
            s = call["sampled_start"]
            routes = call.get("routed_experts")
            force = (forced_routes(model, np.asarray(routes)) if routes is not None
                     else contextlib.nullcontext())
            amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast)
            with torch.no_grad(), force, amp:
                logits = model(ids).logits[0].float()
            lp = torch.log_softmax(logits, -1)[s - 1:-1]
            out.append(lp.gather(-1, ids[0, s:, None])[:, 0].cpu().double().numpy())
    return np.concatenate(out)


def treeflow_sampled_logprobs(model: str, episodes, dtype: str, device: str) -> np.ndarray:
    """treeflow's trainer as the gate scores the refit round: the episodes packed as trees,
    `Trainer.logprobs` (mixed precision in bf16), reassembled per call; flattened in call order."""
    from treeflow.programs.gate import gate_reduce
    from treeflow.stages import Forward, Fragment, Pack, Reassemble
    from treeflow.stages.slots import Slots
    from treeflow.train import Trainer

    routed = "routed_experts" in episodes.schema.field("calls").type.value_type
    fwd = Forward(model=model, dtype=dtype, routing="replay" if routed else "auto")
    trainer = Trainer(fwd, gate_reduce(), device=device, max_tokens=1 << 16)
    pack, fragment = Pack(layout="tree"), Fragment(max_tokens=1 << 16)
    values = trainer.logprobs(fragment(pack(episodes)))
    slots = Slots(episodes)
    return slots.values_from_results(Reassemble()(values, episodes=episodes))[
        slots.calls.mask_S].astype(np.float64)


def floor(model: str, episodes, *, device: str = "cpu", max_episodes: int = 4) -> dict:
    """The floor figures (module docstring) on the first `max_episodes` of `episodes`."""
    import torch
    import transformers

    from tests.weights import as_loaded
    from treeflow.stages.slots import Slots

    episodes = episodes.slice(0, max_episodes)
    rows = episodes.to_pylist()
    slots = Slots(episodes)
    sampler = slots.calls.genlp_S[slots.calls.mask_S].astype(np.float64)
    res: dict = {"episodes": episodes.num_rows, "tokens": int(len(sampler))}
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    hf = hf.to(device).eval()
    ref = hf_sampled_logprobs(hf, rows, autocast=False)
    got = {"hf_autocast": hf_sampled_logprobs(hf, rows, autocast=True)}
    got["hf_bf16"] = hf_sampled_logprobs(as_loaded(hf, torch.bfloat16), rows, autocast=False)
    del hf
    got["sampler"] = sampler
    got["trainer"] = treeflow_sampled_logprobs(model, episodes, "bfloat16", device)
    got["tf_float32"] = treeflow_sampled_logprobs(model, episodes, "float32", device)
    for name, v in got.items():
        if len(v) != len(ref):
            raise ValueError(f"{name}: {len(v)} sampled tokens, transformers has {len(ref)}")
        res[f"kl_{name}_vs_fp32"] = k3(v, ref)
        res[f"absdiff_{name}_vs_fp32"] = float(np.abs(v - ref).mean())
    res["gen_kl"] = k3(got["trainer"], got["sampler"])
    res["hf_bf16_vs_hf_autocast_kl"] = k3(got["hf_autocast"], got["hf_bf16"])
    res["sampler_probability_mean"] = float(np.exp(sampler).mean())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Nemotron-H dir (default: write one)")
    ap.add_argument("--episodes", default=None, help="an episode file (default: sample)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-episodes", type=int, default=4)
    ap.add_argument("--shape", default="cpu-design",
                    help="bench_hybrid_gpu SHAPES key, or cpu-design: the design's layer "
                         "pattern and proportions at hidden 512")
    ap.add_argument("--vocab", type=int, default=None, help="override the shape's vocabulary")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="the smoke-moe shape, tiny sizes")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from treeflow.models.backend import load_backend
    from treeflow.programs.rollout import Rollout, sample_group

    model = args.model
    if model is None:
        model = os.path.join(tempfile.mkdtemp(prefix="treeflow-klfloor-"), "model")
        write_model(model, "smoke-moe" if args.smoke else args.shape, args.vocab)
    if args.episodes:
        from treeflow.schemas.episode_files import read_episodes

        eps = read_episodes(args.episodes)
    else:
        sizes = ((2, 2), (8, 16), (3, 6), (2, 4)) if args.smoke else \
            ((2, 3), (64, 128), (8, 16), (8, 24))
        r = Rollout(group_size=args.group_size, turns=sizes[0], prompt_tokens=sizes[1],
                    completion_tokens=sizes[2], tool_tokens=sizes[3])
        backend = load_backend("reference", model, dtype=torch.bfloat16, device=args.device)
        eps = sample_group(backend, r, 0, producer="gate")
        del backend
    print(json.dumps(floor(model, eps, device=args.device, max_episodes=args.max_episodes),
                     indent=1))


def write_model(path: str, shape: str, vocab: int | None) -> None:
    """A random Nemotron-H MoE written by transformers (bench_hybrid_gpu SHAPES, or cpu-design:
    nemotron-h-moe's pattern, heads and expert proportions at a quarter of its width)."""
    import torch
    import transformers
    from bench_hybrid_gpu import SHAPES

    if shape == "cpu-design":
        cfg = dict(SHAPES["nemotron-h-moe"], vocab_size=16384, hidden_size=512,
                   intermediate_size=2048, num_attention_heads=4, head_dim=128,
                   mamba_num_heads=16, n_groups=2, n_routed_experts=16, moe_intermediate_size=192,
                   moe_shared_expert_intermediate_size=384)
    else:
        cfg = dict(SHAPES[shape])
    if vocab:
        cfg["vocab_size"] = vocab
    torch.manual_seed(0)
    transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg)).save_pretrained(path)


if __name__ == "__main__":
    main()
