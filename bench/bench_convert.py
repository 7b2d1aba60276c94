"""`treeflow convert` throughput on vLLM-style JSON lines made from synthetic agentic episodes.

Writes the synthetic episodes as vLLM chat responses (prompt_token_ids, choices[0].token_ids,
logprobs.content with "token_id:N" tokens), converts them back with the `openai` converter
and checks the result equals the source episodes before reporting. One core.

    python bench/bench_convert.py --episodes 2000 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from treeflow.io import FieldMap, OpenAITokens, convert  # noqa: E402
from treeflow.tools.synth import synth_episodes  # noqa: E402
from treeflow.schemas import read_episodes  # noqa: E402


def write_jsonl(table, path: str) -> None:
    with open(path, "w") as f:
        for row in table.to_pylist():
            calls = []
            for c in row["calls"]:
                ids, s = c["token_ids"], c["sampled_start"]
                lps = c["generation_logprobs"]
                calls.append({"prompt_token_ids": ids[:s], "choices": [{
                    "token_ids": ids[s:], "logprobs": {"content": [
                        {"token": f"token_id:{t}", "logprob": v} for t, v in zip(ids[s:], lps)]}}]})
            f.write(json.dumps({"id": row["episode_id"], "group": row["group_id"],
                                "calls": calls}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-rows", type=int, default=256)
    args = ap.parse_args()
    table = synth_episodes(episodes=args.episodes, group_size=args.group_size, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "log.jsonl"), os.path.join(tmp, "ep.arrow")
        write_jsonl(table, src)
        conv = OpenAITokens(fields=FieldMap(episode_id="id", group_id="group"))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            report = convert([src], out, conv, batch_rows=args.batch_rows)
            times.append(time.perf_counter() - t0)
        got = read_episodes(out)
        def key(t):
            return [(r["episode_id"], r["group_id"],
                     [(c["token_ids"], c["sampled_start"], c["generation_logprobs"]) for c in r["calls"]])
                    for r in t.to_pylist()]

        assert key(got) == key(table), "converted episodes differ from the source"
        size = os.path.getsize(src)
    best = min(times)
    print(json.dumps({
        "episodes": report.episodes, "calls": report.calls, "exact_tokens": report.exact_tokens,
        "jsonl_mib": round(size / 2**20, 1), "seconds": [round(t, 3) for t in times],
        "episodes_per_s": round(report.episodes / best), "exact_tokens_per_s": round(report.exact_tokens / best),
        "mib_per_s": round(size / 2**20 / best, 1), "loadavg_1min": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
