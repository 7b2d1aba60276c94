"""Every Python and shell block of README.md and of the docs site (docs/**/*.md) runs, at tiny
sizes on CPU, or is listed here.

Blocks are fenced (```python, ```bash) or indented by four spaces after a blank line (the
shell commands). Each is keyed by its first line, on whichever page it is. A block runs unless
SKIPPED names it with the reason; a block that neither runs nor is listed fails the test, and
so does a SKIPPED entry whose block is gone from every page. A block that appears on several
pages (README and the site's home) runs once. Before running, SUBSTITUTIONS turn the user's values into tiny
ones (the table below is the mapping). Shell lines call `treeflow.cli.main` in this process
(`. .venv/bin/activate &&` is dropped); Python blocks run in one subprocess, each in a fresh
namespace and directory, with a one-process torchrun environment (for DataParallel.from_env).
Every block's directory holds a copy of one shared synth file (episodes.arrow),
rollouts.jsonl in README's line format and nemo_rl_rollouts.jsonl (NeMo RL's message_log).
"""

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from treeflow.cli import main
from treeflow.tools import synth_episodes, write_episodes

ROOT = Path(__file__).resolve().parents[1]
# README and every page of the site, relative to ROOT
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]

# (pattern, replacement): the user's values -> tiny ones on CPU
SUBSTITUTIONS = [
    (r"--model (DIR|path/to/policy)", "--model tiny"),
    (r"--ref-model (DIR|path/to/policy)", "--ref-model tiny"),
    (r'model="DIR"', 'model="tiny"'),
    (r"--device cuda", "--device cpu"),
    (r'"cuda"', '"cpu"'),
    (r"bfloat16", "float32"),
    (r"(?<![\w-])--episodes \d+", "--episodes 16"),
    (r"--group-size \d+", "--group-size 4"),
    (r"--episodes-per-step \d+", "--episodes-per-step 8"),
    (r"--steps \d+", "--steps 1"),
    (r"treeflow synth", "treeflow synth --min-turns 2 --max-turns 3"),
]

# first line of a block -> why it does not run here
SKIPPED = {
    "treeflow convert rollouts.jsonl --format openai --num-experts 128 --route-width 384 -o episodes.arrow":
        "needs an engine's MoE rollout log (tests/io/test_routes.py converts every payload format)",
    "treeflow convert episodes.arrow --format episodes -o trajectories.jsonl":
        "tests/io/test_atif.py runs the round trip through convert on routed episodes",
    "treeflow gate --config examples/gate_design.yaml --model NEMOTRON_H_MOE_MTP_DIR --device cuda -o gate.json":
        "needs a Nemotron-H MoE checkpoint, a GPU, Ray and TransferQueue; tests/test_cli_gate.py "
        "checks the file's settings, tests/models/ssm/test_hybrid_context_parallel_cli.py runs them",
    "bash scripts/install.sh": "builds a virtual environment (minutes; CI does it)",
    ". .venv/bin/activate && mkdocs serve":
        "serves the site until stopped (tests/test_docs.py builds it with mkdocs build --strict)",
    '. .venv/bin/activate && python -m pytest -q -m "not gpu" -n 2 --dist loadgroup':
        "the test suite itself",
    "treeflow replay episodes.arrow --mode train --num-ranks 2 --device cuda --dtype bfloat16 \\":
        "spawns rank processes (tests/train/test_data_parallel.py runs it, marked multiprocess)",
    "torchrun --nproc-per-node 8 -m treeflow.cli replay episodes.arrow --mode train --num-ranks 8 \\":
        "torchrun across processes/hosts",
    "python -c 'import secrets; print(secrets.token_hex(32))' > /shared/q.secret && chmod 600 /shared/q.secret":
        "two hosts through a TCP queue (tests/test_cli_stream.py runs it on 127.0.0.1)",
    "treeflow stream --queue tf --mode train --episodes-per-step 8 --steps 20 \\":
        "two processes through a queue socket (tests/test_cli_stream.py)",
    "treeflow replay episodes.arrow --episodes-per-step 16 -o replay.arrow":
        "its third line waits for producers on a socket (tests/test_cli_stream.py)",
    "treeflow stream --from episodes.arrow --engine ray --num-ranks 2 --episodes-per-step 16 -o stream.arrow":
        "starts Ray (tests marked ray)",
    "treeflow replay episodes.arrow --engine ray --num-ranks 2 --episodes-per-step 64 -o logprobs.parquet":
        "starts Ray and rank processes (tests/pipeline/test_ray_train.py, marked ray)",
    'pip install -e ".[megatron]"   # megatron-core 0.16.1 on Python 3.11, 0.19.2 on >= 3.12':
        "installs megatron-core; tensor parallelism on GPUs (tests/models/megatron/test_megatron*.py)",
    "from treeflow.pipeline import Pipeline, QueueSource":
        "waits for a producer in another process (tests/tq)",
    "# on host A (node 0) and host B (node 1), the same command but --node-rank:":
        "torchrun across hosts (tests/test_cli_multinode.py runs --nnodes 2 on localhost)",
    "ray start --head --port 6379 --num-gpus 8          # host A (the head)":
        "a Ray cluster across hosts (tests/pipeline/test_ray_two_nodes.py runs two nodes on "
        "localhost, marked ray and slow)",
    "# 2 GPUs, one bin over both: paths of up to 2 x 32k tokens":
        "spawns C processes per bin (tests/test_cli_context_parallel.py, marked multiprocess)",
    "treeflow replay episodes.arrow --engine ray --num-ranks 2 --context-parallel 2 \\":
        "starts Ray and C actors per rank (tests/pipeline/test_ray_context_parallel.py, marked ray)",
    "treeflow synth -o ep.arrow --routes-from DIR      # routes of DIR's shape (MoE layers x top_k)":
        "needs a local MoE checkpoint (tests/models/moe/test_moe_cli.py runs these on a tiny one)",
    "treeflow replay episodes.arrow --model NEMOTRON_H_DIR --ssm-fork chunk -o lp.arrow":
        "needs a local Nemotron-H checkpoint (tests/test_cli_hybrid.py runs it on a tiny one)",
}
# blocks of other kinds are data, not commands
KINDS = {"python": "python", "bash": "shell", "sh": "shell", "indent": "shell"}


def readme_blocks(text: str) -> list[tuple[str, int, str]]:
    """(kind, first line number, code) of every fenced or indented block."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            out.append((m.group(1) or "text", i + 2, "\n".join(lines[i + 1:j])))
            i = j + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or (
                    not lines[j].strip() and j + 1 < len(lines) and lines[j + 1].startswith("    "))):
                j += 1
            out.append(("indent", i + 1, "\n".join(line[4:] for line in lines[i:j])))
            i = j
            continue
        i += 1
    return out


def _substitute(code: str) -> str:
    for pattern, repl in SUBSTITUTIONS:
        code = re.sub(pattern, repl, code)
    return code


def _blocks() -> list[tuple[str, str, int, str]]:
    """(page:line, kind, line, code) of every runnable block on every page, each code once."""
    out, seen = [], set()
    for page in PAGES:
        for kind, line, code in readme_blocks((ROOT / page).read_text()):
            if kind in KINDS and (KINDS[kind], code) not in seen:
                seen.add((KINDS[kind], code))
                out.append((f"{page}:{line}", kind, line, code))
    return out


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    from tests.stages.test_advantage import _rollouts

    d = tmp_path_factory.mktemp("readme-shared")
    write_episodes(synth_episodes(episodes=16, group_size=4, turns=(2, 3), seed=0),
                   d / "episodes.arrow")
    _rollouts(d / "rollouts.jsonl")
    _nemo_rl_groups(d / "nemo_rl_rollouts.jsonl")
    return d


def _nemo_rl_groups(path: Path) -> None:
    """tests/data/nemo_rl.jsonl's two message logs as 4 prompts (`idx`) of 2 generations each
    (without the MoE routes some of its messages carry: the tiny policy is dense)."""
    base = [json.loads(line) for line in (ROOT / "tests" / "data" / "nemo_rl.jsonl").open()]
    for line in base:
        for item in line["message_log"]:  # a message, or an exact call's list of messages
            for message in item if isinstance(item, list) else [item]:
                message.pop("routed_experts", None)
    with path.open("w") as f:
        for idx in range(4):
            for k, line in enumerate(base):
                f.write(json.dumps({**line, "idx": idx, "total_reward": float(k)}) + "\n")


def _workdir(shared, tmp: Path, name: str) -> Path:
    d = tmp / name
    d.mkdir()
    for f in shared.iterdir():
        shutil.copy(f, d / f.name)
    return d


def test_every_block_is_run_or_listed():
    keys = [code.split("\n")[0] for _, _, _, code in _blocks()]
    stale = set(SKIPPED) - set(keys)
    assert not stale, f"SKIPPED lists blocks no page has any more: {sorted(stale)}"


def test_shell_blocks_run(shared, tmp_path, monkeypatch, capsys):
    ran = 0
    for n, (where, kind, line, code) in enumerate(_blocks()):
        if KINDS[kind] != "shell" or code.split("\n")[0] in SKIPPED:
            continue
        work = _workdir(shared, tmp_path, f"sh{n}")
        monkeypatch.chdir(work)
        for command in _substitute(code).replace("\\\n", " ").split("\n"):
            for part in command.split("&&"):
                argv = shlex.split(part, comments=True)
                if not argv or argv[:2] == [".", ".venv/bin/activate"]:
                    continue
                assert argv[0] == "treeflow", (
                    f"{where}: {part.strip()!r} is not a treeflow command; run it "
                    "here or list the block in SKIPPED with the reason")
                try:
                    rc = main(argv[1:])
                except SystemExit as e:  # argparse: an unknown or renamed flag
                    rc = e.code
                err = capsys.readouterr().err
                assert rc == 0, f"{where}: {' '.join(argv)} exited {rc}: {err}"
        ran += 1
    assert ran >= 3


def test_python_blocks_run(shared, tmp_path):
    todo = [(where, _substitute(code)) for where, kind, line, code in _blocks()
            if KINDS[kind] == "python" and code.split("\n")[0] not in SKIPPED]
    assert len(todo) >= 4
    dirs = [str(_workdir(shared, tmp_path, f"py{n}")) for n in range(len(todo))]
    runner = (
        "import json, os, sys, traceback\n"
        "failed = []\n"
        "for (where, code), d in zip(json.loads(sys.argv[1]), json.loads(sys.argv[2])):\n"
        "    os.chdir(d)\n"
        "    try:\n"
        "        exec(compile(code, where, 'exec'), {'__name__': '__readme__'})\n"
        "    except BaseException:\n"
        "        failed.append(f'{where}:\\n' + traceback.format_exc())\n"
        "print(json.dumps(failed))\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-c", runner, json.dumps(todo), json.dumps(dirs)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().split("\n")[-1])
    assert not failed, "\n".join(failed)


# the flags issue 26 added: each is documented in README or the site (and in --help:
# test_cli_honest.py)
NEW_FLAGS = ("--advantage", "--no-std-normalize", "--advantage-eps", "--config", "--print-config",
             "--logger", "--logger-project", "--logger-run-name", "--logger-dir",
             "--mlflow-tracking-uri", "--verbose", "--entropy-coef", "--kl-coef", "--ref-model")


def test_readme_documents_every_new_flag():
    from treeflow.cli import build_parser
    from treeflow.cli.config import subparsers

    text = "\n".join((ROOT / page).read_text() for page in PAGES)
    flags = {o for sub in subparsers(build_parser()).values() for a in sub._actions
             for o in a.option_strings}
    for flag in NEW_FLAGS:
        assert flag in flags, f"{flag} is no flag of any command"
        assert re.search(rf"`{re.escape(flag)}[ `=]", text), f"no page documents {flag}"
