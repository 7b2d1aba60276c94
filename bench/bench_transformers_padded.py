"""Plain transformers with padded batches: the baseline a user without treeflow runs.

Every exact call of every episode is its own sequence (what the inference engine ran),
sorted by length and cut into right-padded batches of at most `--max-tokens` padded
tokens (the same budget `treeflow replay --max-tokens` gets), run through
`AutoModelForCausalLM` (SDPA attention, the model's own `.logits`), and the sampled
tokens' logprobs taken in float32. Sorting by length is the careful user's choice: it
keeps padding low, so this baseline is the strong one, not a straw man.

Timed as `treeflow replay` is, from process start: `startup_seconds` (imports, CUDA
start, model load), `compile_seconds` (one warm-up run of the largest batch: SDPA's
kernels picked), `steady_seconds` (the rest: every batch again, log-softmax, writing). Prints one JSON
object as its last stdout line; `-o` writes the logprobs as treeflow's result table
(`episode_id`, `sample_index`, `logprobs` per episode, calls in order), so the bench can
measure their distance to treeflow's.

    python bench/bench_transformers_padded.py EPISODES.arrow --model DIR --device cuda \
        --dtype bfloat16 --max-tokens 32768 -o hf.arrow --json
"""

from __future__ import annotations

import time

T_PROCESS = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402


def calls_of(table: pa.Table) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Every call's token ids, its sampled start and its episode's row, in file order."""
    calls = table.column("calls").combine_chunks()
    per_episode = np.diff(calls.offsets.to_numpy())
    flat = calls.flatten()
    ids = flat.field("token_ids")
    offs = ids.offsets.to_numpy()
    values = ids.values.to_numpy(zero_copy_only=False).astype(np.int64)
    seqs = [values[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]
    starts = flat.field("sampled_start").to_numpy(zero_copy_only=False).astype(np.int64)
    return seqs, starts, np.repeat(np.arange(len(per_episode)), per_episode)


def batches(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Calls sorted longest first, cut so batch size x longest length <= max_tokens."""
    order = np.argsort(-lengths, kind="stable")
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > max_tokens:
            out.append(np.asarray(cur))
            cur = []
        cur.append(i)
    if cur:
        out.append(np.asarray(cur))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("episodes")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=32768, help="padded tokens per batch")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation")
    ap.add_argument("-o", "--output", default=None)
    ap.add_argument("--json", action="store_true", help="(accepted; JSON is always printed)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                 attn_implementation=args.attn)
    model.to(args.device).eval()
    if args.device == "cuda":
        torch.cuda.synchronize()
    t_loaded = time.perf_counter()

    table = pa.ipc.open_file(args.episodes).read_all()
    seqs, starts, episode_of = calls_of(table)
    lengths = np.asarray([len(s) for s in seqs])
    if int(lengths.max()) > args.max_tokens:
        raise SystemExit(f"a call of {lengths.max()} tokens exceeds --max-tokens {args.max_tokens}")
    plan = batches(lengths, args.max_tokens)
    logprobs: list[np.ndarray | None] = [None] * len(seqs)

    def run(batch: np.ndarray) -> None:
        width = int(lengths[batch].max())
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, :lengths[i]] = torch.from_numpy(seqs[i])
            mask[r, :lengths[i]] = 1
        ids, mask = ids.to(args.device), mask.to(args.device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
            rows, cols, targets = [], [], []
            for r, i in enumerate(batch):  # positions predicting each sampled token
                pos = torch.arange(int(starts[i]) - 1, int(lengths[i]) - 1)
                rows.append(torch.full_like(pos, r))
                cols.append(pos)
                targets.append(torch.from_numpy(seqs[i][int(starts[i]):]))
            rows = torch.cat(rows).to(args.device)
            cols = torch.cat(cols).to(args.device)
            picked = logits[rows, cols].float().log_softmax(-1)
            lp = picked.gather(1, torch.cat(targets).to(args.device)[:, None])[:, 0].cpu().numpy()
        at = 0
        for i in batch:
            n = int(lengths[i] - starts[i])
            logprobs[i] = lp[at:at + n]
            at += n

    run(plan[0])  # warm-up: SDPA kernels chosen, allocator grown (run again below)
    if args.device == "cuda":
        torch.cuda.synchronize()
    t_warm = time.perf_counter()
    for batch in plan:
        run(batch)
    if args.device == "cuda":
        torch.cuda.synchronize()
    per_episode = [[] for _ in range(table.num_rows)]
    for i, e in enumerate(episode_of):
        per_episode[e].append(logprobs[i])
    if args.output:
        flat = [np.concatenate(p).astype(np.float32) if p else np.zeros(0, np.float32)
                for p in per_episode]
        out = pa.table({"episode_id": table.column("episode_id"),
                        "sample_index": table.column("sample_index"),
                        "logprobs": pa.array(flat, type=pa.list_(pa.float32()))})
        with pa.ipc.new_file(args.output, out.schema) as w:
            w.write_table(out)
    t_end = time.perf_counter()
    exact_tokens = int(lengths.sum())
    padded = int(sum(len(b) * lengths[b].max() for b in plan))
    steady = t_end - t_warm
    print(json.dumps({
        "wall_seconds": round(t_end - T_PROCESS, 3),
        "startup_seconds": round(t_loaded - T_PROCESS, 3),
        "compile_seconds": round(t_warm - t_loaded, 3),
        "steady_seconds": round(steady, 3),
        "calls": len(seqs), "batches": len(plan), "exact_tokens": exact_tokens,
        "padded_tokens": padded, "padding_fraction": round(1 - exact_tokens / padded, 4),
        "exact_tokens_per_s": round(exact_tokens / max(steady, 1e-9), 1),
        "peak_memory_gib": (round(torch.cuda.max_memory_allocated() / 2**30, 2)
                            if args.device == "cuda" else None),
    }))


if __name__ == "__main__":
    main()
