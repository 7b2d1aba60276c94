"""The standing catalogue of bad input: every class is refused cleanly and changes nothing.

Each row is one class of user mistake, as a user would make it on the
command line. For each, the command must exit 2 with exactly one line on
stderr that starts with "error:" and names the episode, field, option or
file at fault; no traceback; and every file in the working directory --
inputs, earlier outputs, checkpoints -- must be byte for byte as before,
with nothing new left behind.

The library API (treeflow.train.Policy) has its own section at the end, the same contract in
Python terms (tests/reliability/catalogue_rows_api.py): exactly the row's ValueError or
TypeError, naming the argument or field and the fix; the caller's module and the working
directory unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.reliability import catalogue_rows_52, catalogue_rows_api
from tests.reliability.helpers import TRAIN, cli, small_episodes, tree_hashes, write_small
from treeflow.schemas import EPISODE_SCHEMA

BAD = 2  # the row every data mutation edits; its episode id is named in the message


def rows():
    return small_episodes(4).to_pylist()


def bad_id():
    return rows()[BAD]["episode_id"]


def write_rows(path, rs, schema=EPISODE_SCHEMA):
    t = pa.Table.from_pylist(rs, schema=schema)
    if str(path).endswith(".parquet"):
        pq.write_table(t, path)
    else:
        with pa.ipc.new_file(path, t.schema) as w:
            w.write_table(t)
    return str(path)


def call_edit(**fields):
    def edit(rs):
        rs[BAD]["calls"][0].update(fields)
        return rs
    return edit


def top_edit(**fields):
    def edit(rs):
        rs[BAD].update(fields)
        return rs
    return edit


def sampled(rs):
    c = rs[BAD]["calls"][0]
    return len(c["token_ids"]) - c["sampled_start"]


def set_list(field, value_at, index=0):
    """A per-sampled-token list with value_at(i) at position `index`, valid elsewhere."""
    def edit(rs):
        c = rs[BAD]["calls"][0]
        n = len(c["token_ids"]) - c["sampled_start"]
        base = {"generation_logprobs": -1.0, "loss_mask": True, "advantages": 0.5}[field]
        c[field] = [value_at if i == index else base for i in range(n)]
        return rs
    return edit


def routed_among_unrouted(rs):
    """Episode BAD carries routes on every call, the others none: one window mixes them."""
    for c in rs[BAD]["calls"]:
        c["routed_experts"] = [[1, 2]] * len(c["token_ids"])
    return rs


def null_call(rs):
    rs[BAD]["calls"].append(None)
    return rs


def null_route(rs):
    c = rs[BAD]["calls"][0]
    c["routed_experts"] = [[1, 2]] * len(c["token_ids"])
    c["routed_experts"][1] = None
    return rs


def mixed_routes(rs):
    c = rs[BAD]["calls"][0]
    c["routed_experts"] = [[1, 2]] * len(c["token_ids"])
    c["routed_experts"][3] = [1]
    return rs


def duplicate_id(rs):
    rs[BAD]["episode_id"] = rs[0]["episode_id"]
    return rs


# (name, edit of the rows, needles in the message); the episode id is always required
DATA = [
    ("null-token", call_edit(token_ids=[1, None, 3, 4], sampled_start=2), ["'token_ids' has a null at position 1"]),
    ("null-mask", set_list("loss_mask", None), ["'loss_mask' has a null at position 0"]),
    ("null-logprob", set_list("generation_logprobs", None, 1), ["'generation_logprobs' has a null at position 1"]),
    ("null-advantage", set_list("advantages", None), ["'advantages' has a null at position 0"]),
    ("null-route", null_route, ["'routed_experts' has a null at position 1"]),
    ("positive-logprob", set_list("generation_logprobs", 0.5), ["'generation_logprobs' is 0.5"]),
    ("nan-reward", top_edit(reward=float("nan")), ["'reward' is nan"]),
    ("inf-reward", top_edit(reward=float("inf")), ["'reward' is inf"]),
    ("nan-advantage", top_edit(advantage=float("nan")), ["'advantage' is nan"]),
    ("inf-advantages", set_list("advantages", float("inf")), ["'advantages' holds a non-finite"]),
    ("empty-tokens", call_edit(token_ids=[], sampled_start=1), ["'token_ids' is empty"]),
    ("null-tokens", call_edit(token_ids=None), ["'token_ids' is null"]),
    ("null-call", null_call, ["the call is null"]),
    ("start-zero", call_edit(sampled_start=0), ["'sampled_start' is 0"]),
    ("start-past-end", call_edit(token_ids=[1, 2, 3], sampled_start=4), ["'sampled_start' is 4 for 3 tokens"]),
    ("null-start", call_edit(sampled_start=None), ["'sampled_start' is null"]),
    ("negative-token", call_edit(token_ids=[1, -5, 3], sampled_start=1), ["negative id -5"]),
    ("short-logprobs", lambda rs: call_edit(generation_logprobs=[-1.0] * (sampled(rs) + 1))(rs),
     ["'generation_logprobs' has"]),
    ("short-mask", lambda rs: call_edit(loss_mask=[True] * (sampled(rs) + 2))(rs), ["'loss_mask' has"]),
    ("short-routes", call_edit(routed_experts=[[1]]), ["'routed_experts' has 1 entries"]),
    ("mixed-routes", mixed_routes, ["mixes route widths"]),
    ("routed-and-unrouted", routed_among_unrouted,
     ["bad.parquet", "carries routed_experts and episode", "does not, in one window"]),
    ("empty-calls", top_edit(calls=[]), ["'calls' is empty"]),
    ("null-calls", top_edit(calls=None), ["'calls' is null"]),
    ("null-id", top_edit(episode_id=None), ["row 2", "'episode_id' is null"]),
    # one row's sample_index null (all null is row order, as absent is)
    ("null-sample-index", top_edit(sample_index=None), ["'sample_index' is null", "row order"]),
]


# nulls where the episode schema says non-nullable: written with an inferred schema, as a user's
# own writer would (the declared schema would refuse them before they reach a file)
_INFERRED = {"null-tokens", "null-start", "null-calls", "null-id", "null-sample-index"}


def _data_case(name, edit, needles):
    def setup(tmp):
        rs = edit(rows())
        schema = None if name in _INFERRED else EPISODE_SCHEMA
        return ["plan", write_rows(tmp / "bad.parquet", rs, schema), "--max-tokens", "256", "-o",
                tmp / "bins.arrow"], \
            ["bad.parquet", *needles] + ([] if "row 2" in needles else [repr(bad_id())])
    return setup


def _file_case(kind):
    def setup(tmp):
        good = write_small(tmp / "e.arrow")
        if kind == "dup-id":
            return ["plan", write_rows(tmp / "d.arrow", duplicate_id(rows())), "--max-tokens", "64"], \
                ["d.arrow", "appears more than once"]
        if kind == "no-calls-column":
            pq.write_table(pa.table({"episode_id": ["a"]}), tmp / "nc.parquet")
            return ["inspect", tmp / "nc.parquet"], ["nc.parquet", "'calls'"]
        if kind == "reward-string":
            rs = [dict(r, reward="high") for r in rows()]
            return ["inspect", write_rows(tmp / "s.parquet", rs, schema=None)], ["s.parquet", "'reward'"]
        if kind == "unknown-call-field":
            rs = rows()
            for r in rs:
                for c in r["calls"]:
                    c["tokens"] = [1]
            return ["inspect", write_rows(tmp / "u.parquet", rs, schema=None)], ["u.parquet", "'tokens'"]
        if kind == "schema-version":
            t = small_episodes(2).replace_schema_metadata({"treeflow.schema": "episode/7"})
            with pa.ipc.new_file(tmp / "v.arrow", t.schema) as w:
                w.write_table(t)
            return ["inspect", tmp / "v.arrow"], ["v.arrow", "'episode/7'"]
        if kind == "missing-file":
            return ["inspect", tmp / "nope.arrow"], ["nope.arrow", "no such file"]
        if kind == "empty-glob":
            return ["inspect", tmp / "*.nothing"], ["*.nothing", "matches no file"]
        if kind == "empty-dir":
            (tmp / "empty").mkdir()
            return ["inspect", tmp / "empty"], ["empty", "no .arrow or .parquet"]
        if kind == "junk-arrow":
            (tmp / "junk.arrow").write_bytes(b"hello, not arrow")
            return ["inspect", tmp / "junk.arrow"], ["junk.arrow", "neither an Arrow IPC file"]
        if kind == "truncated-parquet":
            data = open(write_rows(tmp / "t.parquet", rows()), "rb").read()
            (tmp / "t.parquet").write_bytes(data[: len(data) // 2])
            return ["inspect", tmp / "t.parquet"], ["t.parquet", "Parquet"]
        if kind == "gate-episodes-groups":
            return ["gate", "--episodes", "6", "--group-size", "4"], ["Gate(episodes=6)", "group size 4"]
        if kind == "gate-capacity":
            return ["gate", "--capacity", "16"], ["--capacity 16", ">= 32"]
        if kind == "gate-episodes-out-suffix":  # refused before any sampling
            return ["gate", "--episodes-out", tmp / "kept.json"], ["--episodes-out", "kept.json",
                                                                   "'.arrow'"]
        if kind == "gate-context-parallel-zero":
            return ["gate", "--context-parallel", "0"], ["--context-parallel 0",
                                                         "give 1 or more processes"]
        if kind == "csv-input":
            (tmp / "x.csv").write_text("a,b\n")
            return ["inspect", tmp / "x.csv"], ["x.csv", "unknown episode file type"]
        if kind == "vocab":
            rs = rows()
            rs[BAD]["calls"][0]["token_ids"][1] = 10 ** 6
            return ["replay", write_rows(tmp / "big.arrow", rs), "-o", tmp / "o.arrow"], \
                ["big.arrow", repr(bad_id()), "vocabulary size"]
        if kind == "o-is-input":
            return ["replay", good, "-o", good], ["e.arrow", "also an input"]
        if kind == "o-dir-missing":
            return ["plan", good, "--max-tokens", "64", "-o", tmp / "no" / "b.arrow"], ["no", "does not exist"]
        if kind == "o-is-dir":
            (tmp / "d").mkdir()
            return ["plan", good, "--max-tokens", "64", "-o", tmp / "d"], ["d", "is a directory"]
        if kind == "o-csv":
            return ["plan", good, "--max-tokens", "64", "-o", tmp / "b.csv"], ["b.csv", "unknown output type"]
        if kind == "logprobs-no-o":
            return ["replay", good], ["-o"]
        if kind == "ranks-0":
            return ["plan", good, "--max-tokens", "64", "--num-ranks", "0"], ["--num-ranks 0"]
        if kind == "plan-rank-out-of-range":
            return ["plan", good, "--max-tokens", "64", "--num-ranks", "2", "--rank", "2"], ["--rank 2"]
        if kind == "context-parallel-0":
            return ["plan", good, "--max-tokens", "64", "--context-parallel", "0"], \
                ["--context-parallel 0"]
        if kind == "context-parallel-megatron":
            return ["replay", good, *TRAIN, "--context-parallel", "2", "--backend", "megatron"], \
                ["--context-parallel 2", "--backend reference"]
        if kind == "max-tokens-0":
            return ["plan", good, "--max-tokens", "0"], ["--max-tokens 0"]
        if kind == "device":
            return ["replay", good, "-o", tmp / "o.arrow", "--device", "tpu"], ["'tpu'"]
        if kind == "model-missing":
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"], ["m", "does not exist"]
        if kind == "model-config-null":
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text("null")
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"], ["config.json"]
        if kind == "model-index-escapes":  # a shard index naming a file outside the directory
            from treeflow.models import load_model, save_model

            save_model(load_model("tiny"), tmp / "m")
            os.remove(tmp / "m" / "model.safetensors")
            (tmp / "m" / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"model.embed_tokens.weight": "../x.safetensors"}}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"], \
                ["model.safetensors.index.json", "not files beside it"]
        if kind in ("model-mtp", "model-hybrid-moe"):
            (tmp / "m").mkdir()
            cfg = ({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_nextn_predict_layers": 1} if kind == "model-mtp" else
                   {"architectures": ["NemotronHForCausalLM"], "vocab_size": 64,
                    "hidden_size": 32, "intermediate_size": 64,
                    "layers_block_type": ["linear_attention", "moe"], "n_shared_experts": 2})
            (tmp / "m" / "config.json").write_text(json.dumps(cfg))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"], \
                (["config.json", "multi-token-prediction"] if kind == "model-mtp" else
                 ["config.json", "n_shared_experts=2"])
        if kind == "train-over-device-memory":  # cli/memory.py, before the model loads
            return ["replay", good, *TRAIN[:-3], "--max-tokens", "4096", "--json",
                    "--recompute", "none", "--device-memory", "100MiB"], \
                ["--max-tokens 4096", "--recompute selective"]
        if kind == "train-over-device-memory-auto":  # --recompute auto found no mode that fits
            return ["replay", good, *TRAIN[:-3], "--max-tokens", "4096", "--json",
                    "--device-memory", "100MiB"], \
                ["(--recompute full)", "--max-tokens 4096", "the largest that fits"]
        if kind == "device-memory-junk":
            return ["plan", "--memory", "--model", "tiny", "--max-tokens", "64",
                    "--device-memory", "lots"], ["--device-memory 'lots'", "80GiB"]
        if kind == "plan-memory-config-not-object":  # cli/memory.py: --model as a config file
            (tmp / "bad.json").write_text("[1, 2]")
            return ["plan", "--memory", "--model", tmp / "bad.json", "--max-tokens", "64"], \
                ["bad.json", "holds list", "config.json"]
        if kind == "plan-memory-half-mode-mamba2":  # train/memory_activations.py: no halves
            (tmp / "h.json").write_text(json.dumps(
                {"architectures": ["NemotronHForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 64, "num_hidden_layers": 2,
                 "hybrid_override_pattern": "M*", "num_attention_heads": 4,
                 "num_key_value_heads": 2, "mamba_num_heads": 4, "mamba_head_dim": 16,
                 "ssm_state_size": 8, "n_groups": 1, "chunk_size": 4}))
            return ["plan", "--memory", "--model", tmp / "h.json", "--max-tokens", "64",
                    "--recompute", "mlp"], \
                ["--recompute mlp", "Mamba-2 hybrid", "none, selective or full"]
        if kind == "ssm-kernel-triton-cpu":  # the fused scan runs on CUDA only
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text(json.dumps(
                {"architectures": ["NemotronHForCausalLM"], "vocab_size": 64,
                 "hidden_size": 32, "layers_block_type": ["linear_attention"]}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m",
                    "--ssm-kernel", "triton"], ["--ssm-kernel triton"]
        if kind in ("hybrid-cp-heads", "gate-hybrid-cp-heads"):  # models/support.py, before a load
            (tmp / "m").mkdir()
            cfg = {"architectures": ["NemotronHForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                   "intermediate_size": 64, "mamba_num_heads": 4, "mamba_head_dim": 8,
                   "n_groups": 2, "ssm_state_size": 8, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 8,
                   "layers_block_type": ["linear_attention", "full_attention"]}
            (tmp / "m" / "config.json").write_text(json.dumps(cfg))
            argv = (["gate", "--model", tmp / "m"] if kind.startswith("gate") else
                    ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"])
            return [*argv, "--context-parallel", "5"], ["--context-parallel 5",
                                                         "mamba_num_heads=4"]
        if kind == "model-gemma3-softcap":  # a Gemma 3 option the decoder does not implement
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text(json.dumps(
                {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "final_logit_softcapping": 30.0}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"], \
                ["config.json", "final_logit_softcapping=30.0"]
        if kind == "model-family-not-yet":  # a family the field trains, not read yet
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text(json.dumps(
                {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"], \
                ["config.json", "Qwen3.5 vision-language", "is not supported",
                 "Qwen3 (Qwen3ForCausalLM)"]
        if kind == "offload-without-shard-params":  # CPUOffloadPolicy is FSDP2's (fsdp.py)
            return ["replay", good, *TRAIN, "--model", "tiny", "--offload"], \
                ["--offload", "add --shard-params"]
        if kind == "gdn-cp":  # more context-parallel ranks than GDN value heads (support.py)
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text(json.dumps(
                {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "linear_num_value_heads": 4, "linear_num_key_heads": 2}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m",
                    "--context-parallel", "5"], ["Gated DeltaNet", "linear_num_value_heads=4",
                                                 "--context-parallel 5"]
        if kind == "gdn-ssm-kernel-triton":  # Mamba-2's fused scan asked of a GDN model
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text(json.dumps(
                {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m",
                    "--ssm-kernel", "triton"], ["Qwen3NextForCausalLM", "--ssm-kernel torch"]
        if kind == "megatron-family":  # a family MCore has no model of (families.py)
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text(json.dumps(
                {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "sliding_window": 4}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m", "--backend",
                    "megatron"], ["Gemma 3 (Gemma3ForCausalLM)", "--backend reference"]
        if kind == "megatron-glm-group-rule":  # a group limit MCore scores otherwise (issue 51)
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text(json.dumps(
                {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 8, "n_shared_experts": 1, "n_group": 4,
                 "topk_group": 2}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m", "--backend",
                    "megatron"], ["Glm4MoeForCausalLM", "topk_group=2", "--backend reference"]
        if kind == "model-gpt-oss-mxfp4":  # the released gpt-oss checkpoints' MXFP4 experts
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text(json.dumps(
                {"architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_local_experts": 4, "num_experts_per_tok": 2,
                 "quantization_config": {"quant_method": "mxfp4"}}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"], \
                ["config.json", "quantization_config", "dequantize"]
        if kind == "model-deepseek-fp8":  # the released DeepSeek-V3 checkpoints' FP8 weights
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text(json.dumps(
                {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                 "n_shared_experts": 1, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                 "qk_rope_head_dim": 8, "v_head_dim": 8,
                 "quantization_config": {"quant_method": "fp8"}}))
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"], \
                ["config.json", "DeepseekV3ForCausalLM", "quantization_config", "dequantize"]
        if kind == "no-batch":
            return ["replay", good, "--mode", "train"], ["--episodes-per-step"]
        if kind == "steps-0":
            return ["replay", good, *TRAIN, "--steps", "0"], ["--steps 0"]
        if kind == "save-every-negative":
            return ["replay", good, *TRAIN, "--save", tmp / "c", "--save-every", "-1"], ["--save-every -1"]
        if kind == "save-every-no-save":
            return ["replay", good, *TRAIN, "--save-every", "2"], ["--save DIR"]
        if kind == "keep-0":
            return ["replay", good, *TRAIN, "--save", tmp / "c", "--keep", "0"], ["--keep 0"]
        if kind == "save-is-file":
            return ["replay", good, *TRAIN, "--save", good], ["e.arrow"]
        if kind == "metrics-is-input":
            return ["replay", good, *TRAIN, "--metrics", good], ["--metrics", "also an input"]
        if kind == "metrics-exists":
            (tmp / "m.jsonl").write_text('{"step": 1}\n')
            return ["replay", good, *TRAIN, "--metrics", tmp / "m.jsonl"], ["m.jsonl", "another run"]
        if kind == "resume-missing":
            return ["replay", good, *TRAIN, "--resume", tmp / "ck"], ["ck", "no such checkpoint"]
        if kind == "resume-not-checkpoint":
            (tmp / "ck").mkdir()
            return ["replay", good, *TRAIN, "--resume", tmp / "ck"], ["ck", "not a treeflow training"]
        if kind == "resume-unverifiable":  # no manifest: refused unless --trust-checkpoint
            (tmp / "ck" / "dcp").mkdir(parents=True)
            (tmp / "ck" / "dcp" / ".metadata").write_bytes(b"\x80\x04N.")
            return ["replay", good, *TRAIN, "--resume", tmp / "ck"], ["ck", "--trust-checkpoint"]
        if kind in ("megatron-moe-tp-cpu", "megatron-moe-aux"):
            model = _moe_dir(tmp / "moe", aux=kind == "megatron-moe-aux", kv_heads=2)
            if kind == "megatron-moe-aux":
                return ["replay", good, "-o", tmp / "o.arrow", "--model", model, "--backend",
                        "megatron"], ["router aux loss", "--backend reference"]
            return ["replay", good, "-o", tmp / "o.arrow", "--model", model, "--backend",
                    "megatron", "--tensor-parallel", "2"], ["--tensor-parallel 2", "needs CUDA"]
        if kind in ("moe-route-width", "moe-capacity", "replay-dense", "moe-aux-no-routes"):
            model = _moe_dir(tmp / "moe", capacity=kind == "moe-capacity",
                             aux=kind == "moe-aux-no-routes")
            if kind == "moe-aux-no-routes":
                return ["replay", good, *TRAIN, "--model", model], \
                    ["router aux loss", "routed_experts"]
            if kind == "replay-dense":
                return ["replay", good, "-o", tmp / "o.arrow", "--routing", "replay"], \
                    ["routing='replay'", "no experts"]
            if kind == "moe-capacity":
                return ["replay", good, "-o", tmp / "o.arrow", "--model", model], \
                    ["capacity_factor", "every call sharing it"]
            rs = rows()
            for r in rs:
                for c in r["calls"]:
                    c["routed_experts"] = [[0, 1, 2]] * len(c["token_ids"])
            return ["replay", write_rows(tmp / "w.arrow", rs), "-o", tmp / "o.arrow", "--model",
                    model], ["w.arrow", "width 3", "replays width 2"]
        if kind in ("token-strings", "token-floats", "int-episode-id"):  # never cast silently
            rs = rows()
            for r in rs:
                for c in r["calls"]:
                    if kind != "int-episode-id":
                        c["token_ids"] = [str(t) if kind == "token-strings" else float(t)
                                          for t in c["token_ids"]]
                if kind == "int-episode-id":
                    r["episode_id"] = int(r["sample_index"])
            path = write_rows(tmp / "w.arrow", rs, schema=None)
            return ["plan", path, "--max-tokens", "64"], ["w.arrow", "does not cast"]
        if kind == "stream-metrics-is-input":
            return ["stream", "--from", good, "-o", tmp / "steps", "--metrics", good], \
                ["--metrics", "also an input"]
        if kind == "logger-unknown":
            return ["replay", good, *TRAIN, "--logger", "console,neptune"], ["--logger neptune"]
        if kind == "logger-jsonl":  # the log is --metrics FILE's; the name switched nothing on
            return ["replay", good, *TRAIN, "--logger", "jsonl"], ["--logger jsonl", "--metrics"]
        if kind == "old-flag":  # issue 47: a name whose release is over, and the new one
            return ["replay", good, *TRAIN, "--batch-episodes", "2"], \
                ["--batch-episodes is now --episodes-per-step"]
        if kind == "old-config-key":
            (tmp / "run.yaml").write_text("ranks: 2\n")
            return ["replay", good, *TRAIN, "--config", tmp / "run.yaml"], \
                ["run.yaml", "'ranks' is now 'num_ranks'"]
        if kind == "config-wrong-group":
            (tmp / "run.yaml").write_text("model: {lr: 0.1}\n")
            return ["replay", good, *TRAIN, "--config", tmp / "run.yaml"], \
                ["run.yaml", "model.lr", "lr is in the train group"]
        if kind == "config-twice":
            (tmp / "run.yaml").write_text("lr: 0.1\ntrain: {lr: 0.2}\n")
            return ["replay", good, *TRAIN, "--config", tmp / "run.yaml"], \
                ["run.yaml", "lr and train.lr set the same option"]
        if kind == "tensorboard-is-input":
            return ["replay", good, *TRAIN, "--tensorboard", good], ["--tensorboard", "e.arrow"]
        if kind == "config-architectures-nested":
            (tmp / "m").mkdir()
            (tmp / "m" / "config.json").write_text('{"architectures": [["LlamaForCausalLM"]]}')
            return ["replay", good, "-o", tmp / "o.arrow", "--model", tmp / "m"], \
                ["config.json", "'architectures'"]
        if kind == "truncated-stream":
            t = small_episodes(4)
            with pa.ipc.new_stream(tmp / "s.arrow", t.schema) as w:
                for b in t.to_batches(max_chunksize=1):
                    w.write_batch(b)
            data = (tmp / "s.arrow").read_bytes()
            (tmp / "s.arrow").write_bytes(data[: len(data) * 3 // 4])
            return ["inspect", tmp / "s.arrow"], ["s.arrow", "truncated"]
        if kind in ("json-too-deep", "json-huge-int"):
            bad = ('{"x": ' + "[" * 5000 + "]" * 5000 + "}" if kind == "json-too-deep"
                   else '{"episode_id": "a", "n": ' + "9" * 5000 + "}")
            (tmp / "log.jsonl").write_text(bad + "\n")
            return ["convert", tmp / "log.jsonl", "-o", tmp / "c.arrow", "--format", "openai"], \
                ["log.jsonl line 1"]
        if kind == "route-expert-range":  # issue 50: an SGLang payload with an id past the experts
            import base64

            ids = base64.b64encode(bytes([1, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0])).decode()
            call = {"request": {"input_ids": [1, 2]}, "response": {"output_ids": [3], "meta_info": {
                "output_token_logprobs": [[-0.5, 3, None]], "routed_experts": ids}}}
            (tmp / "log.jsonl").write_text(json.dumps({"episode_id": "a", "calls": [call]}) + "\n")
            return ["convert", tmp / "log.jsonl", "-o", tmp / "c.arrow", "--format", "openai",
                    "--num-experts", "8"], ["log.jsonl line 1, call 0", "meta_info.routed_experts",
                                            "expert id 9", "--num-experts"]
        if kind == "nemo-rl-replica-disagrees":
            msgs = [{"role": "user", "token_ids": [1, 2], "ng_generation_replica_id": "a"},
                    {"role": "assistant", "token_ids": [3], "generation_logprobs": [-0.5],
                     "ng_generation_replica_id": "b"}]
            (tmp / "log.jsonl").write_text(json.dumps({"message_log": [msgs], "total_reward": 1.0})
                                           + "\n")
            return ["convert", tmp / "log.jsonl", "-o", tmp / "c.arrow", "--format", "nemo-rl"], \
                ["log.jsonl line 1", "ng_generation_replica_id"]
        if kind == "close-when":
            return ["stream", "--from", good, "-o", tmp / "o.arrow", "--close-when", "sometimes"], \
                ["--close-when sometimes", "first"]
        if kind.startswith("lease-"):  # issue 27: stream --lease per-rank
            train = ["stream", "--from", good, "--mode", "train", "--num-ranks", "2", "--lease",
                     "per-rank"]
            return {"lease-ray": ([*train, "--episodes-per-step", "4", "--engine", "ray"],
                                  ["--lease per-rank --engine ray", "--engine local"]),
                    "lease-uneven": ([*train, "--episodes-per-step", "3"],
                                     ["--episodes-per-step 3", "--num-ranks 2"]),
                    "lease-logprobs": (["stream", "--from", good, "-o", tmp / "o.arrow", "--lease",
                                        "per-rank"], ["--lease per-rank", "--mode train"])}[kind]
        if kind.startswith("queue-"):  # issue 27: the queue over TCP (tq/tcp.py)
            return _queue_case(kind, tmp, good)
        if kind == "max-attempts-0":
            return ["stream", "--from", good, "-o", tmp / "o.arrow", "--max-attempts", "0"], \
                ["--max-attempts 0"]
        if kind == "advantage-no-reward":
            rs = [dict(r, reward=None, advantage=None) for r in rows()]
            return ["replay", write_rows(tmp / "nr.arrow", rs), *TRAIN, "--advantage", "grpo"], \
                ["'reward' is missing", "--advantage grpo"]
        if kind == "group-split":   # interleaved groups are gathered, within --group-window
            rs = rows()
            rs = [rs[0], rs[2], rs[1], rs[3]]  # g0 g1 g0 g1: g0 spans 3 episodes
            return ["replay", write_rows(tmp / "gs.arrow", rs), *TRAIN, "--advantage", "rloo",
                    "--group-window", "2"], \
                ["group 'g0'", "gs.arrow row 0", "--group-window"]
        if kind == "advantage-no-group":
            rs = top_edit(group_id=None)(rows())
            return ["replay", write_rows(tmp / "ng.arrow", rs), *TRAIN, "--advantage", "grpo"], \
                [f"episode {bad_id()!r}", "ng.arrow row 2", "has no group_id", "--advantage grpo"]
        if kind == "config-unknown-key":
            (tmp / "run.yaml").write_text("episode_per_step: 2\n")
            return ["replay", good, "--config", tmp / "run.yaml"], \
                ["run.yaml", "did you mean --episodes-per-step?"]
        if kind == "lr-negative":
            return ["replay", good, *TRAIN, "--lr", "-1"], ["--lr -1.0"]
        if kind == "compile-cache-open":  # a compile cache is code: others must not write it
            (tmp / "cc").mkdir()
            os.chmod(tmp / "cc", 0o777)
            return ["replay", good, "-o", tmp / "lp.arrow", "--compile-cache", tmp / "cc"], \
                [str(tmp / "cc"), "writable by group or others"]
        if kind == "kl-coef":
            return ["replay", good, *TRAIN, "--kl-coef", "0.1"], ["--kl-coef 0.1", "--ref-model DIR"]
        if kind == "ref-model-no-kl":
            return ["replay", good, *TRAIN, "--ref-model", tmp / "ref"], \
                ["--ref-model", "--kl-coef C > 0"]
        if kind == "ref-model-vocab":  # the KL compares the same tokens' logprobs
            from treeflow.models import ModelConfig, load_model, save_model

            save_model(load_model(dataclasses.replace(ModelConfig.tiny(), vocab_size=40000)),
                       tmp / "ref")
            return ["replay", good, *TRAIN, "--kl-coef", "0.1", "--ref-model", tmp / "ref"], \
                ["reference policy", "40000", "the policy's tokenizer"]
        raise AssertionError(kind)
    return setup


def _tcp_server(secret_file: str) -> str:
    """A queue server in this process on 127.0.0.1 (its accept loop in a daemon thread)."""
    import threading

    from treeflow.tq import tcp, wire
    from treeflow.tq.ledger import Ledger
    from treeflow.tq.server import serve_connections

    listener = tcp.listen(tcp.TcpAddress("127.0.0.1", 0))
    threading.Thread(target=serve_connections, args=(listener, Ledger(), wire.read_secret_file(secret_file)),
                     daemon=True).start()
    return f"tcp://127.0.0.1:{listener.getsockname()[1]}"


def _queue_case(kind, tmp, good):
    from treeflow.tq.tcp import make_secret_file

    stream = ["stream", "--from", good, "-o", tmp / "o.arrow", "--queue"]
    if kind == "queue-tcp-no-port":
        return [*stream, "tcp://localhost"], ["tcp://localhost", "names no port"]
    if kind == "queue-tcp-no-secret":
        return [*stream, "tcp://0.0.0.0:5555"], ["tcp://0.0.0.0:5555", "--queue-secret"]
    if kind == "queue-secret-mode":
        path = make_secret_file(str(tmp / "s.secret"))
        os.chmod(path, 0o644)
        return [*stream, "tcp://127.0.0.1:5555", "--queue-secret", path], ["s.secret", "0644"]
    if kind == "queue-secret-not-hex":
        (tmp / "s.secret").write_text("hunter2\n")
        os.chmod(tmp / "s.secret", 0o600)
        return [*stream, "tcp://127.0.0.1:5555", "--queue-secret", str(tmp / "s.secret")], \
            ["s.secret", "64 hex digits"]
    if kind == "queue-secret-unix":
        path = make_secret_file(str(tmp / "s.secret"))
        return [*stream, "q", "--queue-secret", path], ["--queue-secret", "tcp://"]
    if kind == "queue-tcp-wrong-secret":
        address = _tcp_server(make_secret_file(str(tmp / "server.secret")))
        mine = make_secret_file(str(tmp / "mine.secret"))
        return ["stream", "--produce-only", "--from", good, "--queue", address, "--queue-secret",
                mine, "--connect-timeout", "5"], [address, "refused this client's secret",
                                                  "mine.secret"]
    raise AssertionError(kind)


def _moe_dir(path, *, capacity: bool = False, aux: bool = False, kv_heads: int = 1) -> str:
    """A tiny Qwen3-MoE checkpoint (1 layer, top-2: routes of width 2), saved by treeflow."""
    from treeflow.models import ModelConfig, load_model, save_model

    d = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=32000, hidden_size=16,
             intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=kv_heads, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
             output_router_logits=aux, router_aux_loss_coef=0.01)
    save_model(load_model(ModelConfig.from_hf_dict(d)), path)
    if capacity:
        import json

        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "capacity_factor": 1.25}))
    return str(path)


FILES = ["dup-id", "no-calls-column", "reward-string", "unknown-call-field", "schema-version",
         "missing-file", "empty-glob", "empty-dir", "junk-arrow", "truncated-parquet", "csv-input",
         "vocab", "o-is-input", "o-dir-missing", "o-is-dir", "o-csv", "logprobs-no-o", "ranks-0",
         "plan-rank-out-of-range",
         "max-tokens-0", "device", "model-missing", "model-config-null", "model-index-escapes",
         "model-mtp", "model-hybrid-moe", "hybrid-cp-heads", "gate-hybrid-cp-heads",
         "model-mtp", "model-hybrid-moe", "model-family-not-yet", "gdn-cp",
         "gdn-ssm-kernel-triton", "megatron-family",
         "model-gemma3-softcap", "model-gpt-oss-mxfp4", "model-deepseek-fp8",
         "no-batch", "steps-0",
         "save-every-negative", "save-every-no-save", "keep-0", "save-is-file", "metrics-is-input",
         "metrics-exists", "resume-missing", "resume-not-checkpoint", "resume-unverifiable",
         "moe-route-width", "moe-capacity", "replay-dense", "moe-aux-no-routes",
         "context-parallel-0", "context-parallel-megatron", "close-when", "max-attempts-0",
         "advantage-no-reward", "group-split", "advantage-no-group", "config-unknown-key",
         "lr-negative", "kl-coef",
         "ref-model-no-kl", "ref-model-vocab",
         # issue 20
         "token-strings", "token-floats", "int-episode-id", "stream-metrics-is-input",
         "tensorboard-is-input", "config-architectures-nested", "truncated-stream",
         "json-too-deep", "json-huge-int",
         # issue 27: the queue over TCP
         "queue-tcp-no-port", "queue-tcp-no-secret", "queue-secret-mode", "queue-secret-not-hex",
         "queue-secret-unix", "queue-tcp-wrong-secret", "lease-ray", "lease-uneven",
         "lease-logprobs",
         # issue 25
         "compile-cache-open",
         # issue 22
         "nemo-rl-replica-disagrees", "megatron-moe-tp-cpu", "megatron-moe-aux",
         # issue 50: engine route payloads
         "route-expert-range",
         # issue 26: trackers
         "logger-unknown", "logger-jsonl",
         # issue 45: the fused Mamba-2 scan
         "ssm-kernel-triton-cpu",
         # issue 44: memory
         "train-over-device-memory", "train-over-device-memory-auto", "device-memory-junk", "plan-memory-config-not-object",
         "plan-memory-half-mode-mamba2",
         # issue 47: the command line's groups and removed names
         "old-flag", "old-config-key", "config-wrong-group", "config-twice",
         # issue 44: --offload is FSDP2's (every family shards, under context parallelism too)
         "offload-without-shard-params",
         # issue 51: GLM-4.5 on the megatron backend
         "megatron-glm-group-rule"]

CASES = [pytest.param(_data_case(name, edit, needles), id=name) for name, edit, needles in DATA] + \
        [pytest.param(_file_case(kind), id=kind) for kind in FILES]
CASES += [pytest.param(_file_case(kind), id=kind) for kind in ("gate-episodes-groups",
                                                               "gate-capacity",
                                                               "gate-episodes-out-suffix",
                                                               "gate-context-parallel-zero")]

# issue 52: config files, checkpoints, convert lines, trackers, outputs (catalogue_rows_52.py)
CASES += [pytest.param(setup, id=kind) for kind, setup in catalogue_rows_52.ROWS.items()]


def test_catalogue_is_large_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("setup", CASES)
def test_refused_cleanly_and_nothing_changes(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as a user runs it (tests/conftest.py)
    # an earlier good output sits next to the inputs: it must survive the refusal
    (tmp_path / "bins.arrow").write_bytes(b"an earlier output")
    with catalogue_rows_52.CLEANUP:  # what a row set up outside tmp_path (a mount, a socket)
        argv, needles = setup(tmp_path)
        before = tree_hashes(tmp_path)
        rc, out, err = cli(capsys, *argv)
        after = tree_hashes(tmp_path)  # a mounted disk's files too, before it goes
        partial = [n for _, _, ns in os.walk(tmp_path) for n in ns if n.endswith(".partial")]
    assert rc == 2, err
    assert "Traceback" not in err and "Traceback" not in out
    assert err.startswith("error:") and err.count("\n") == 1, err
    for n in needles:
        assert str(n) in err, f"{n!r} not in {err!r}"
    assert after == before
    assert not partial


# the library API (issue 50): Policy's refusals, as a trainer's author meets them
API_CASES = [pytest.param(name, id=name) for name in catalogue_rows_api.ROWS]
API_GROUP_CASES = [pytest.param(name, id=name) for name in catalogue_rows_api.group_needles()]


def _api_refusal(name, got, cls, needles):
    kind, message, unchanged = got
    assert kind == cls.__name__, (name, kind, message)
    for n in needles:
        assert n in message, f"{n!r} not in {message!r}"
    assert "Traceback" not in message
    assert unchanged, f"{name}: the caller's module changed"


@pytest.mark.parametrize("name", API_CASES)
def test_api_refused_cleanly_and_nothing_changes(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bins.arrow").write_bytes(b"an earlier output")
    before = tree_hashes(tmp_path)
    action, cls, needles = catalogue_rows_api.ROWS[name]
    got = catalogue_rows_api.run_row(catalogue_rows_api.model(), action)
    _api_refusal(name, got, cls, needles)
    assert tree_hashes(tmp_path) == before


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", API_GROUP_CASES)
def test_api_refused_cleanly_under_a_process_group(name):
    cls, needles = catalogue_rows_api.group_needles()[name]
    _api_refusal(name, catalogue_rows_api.group_results()[name], cls, needles)
