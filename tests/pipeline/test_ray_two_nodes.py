"""The Ray engine's training across two Ray nodes equals one local process (1e-6).

Two hosts the way a user starts them, on localhost: `ray start --head` and `ray start --address`
(two raylets, two object stores, one GCS), then
`treeflow replay --mode train --engine ray --num-ranks 2` as a driver attached through
RAY_ADDRESS, as on a cluster. The scheduler is told to spread (`scheduler_spread_threshold` 0),
and the test reads from the GCS that the two rank actors ran on different nodes, so the
process group, the planning exchange and the gradient sum really crossed nodes.

The cluster is this test's own (its own temp dir and ports; each node is stopped by its own
process id, never `ray stop`), and everything that talks to it runs in subprocesses, so the
session's Ray cluster (tests/conftest.py) is never touched.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from safetensors.torch import load_file

from treeflow.tools import synth_episodes, write_episodes
from treeflow.train.launch import free_port

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = ["--mode", "train", "--episodes-per-step", "4", "--steps", "2", "--lr", "1e-2",
         "--warmup-episodes", "2", "--loss", "pg", "--norm", "seq-mean", "--max-tokens", "256",
         "--grad-sum", "float64", "--quiet"]
_NODES = """
import json, sys, ray
from ray._private.state import actors
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
ranks = [a["Address"]["NodeID"] for a in actors().values() if a["ActorClassName"] == "RankActor"]
print(json.dumps({"nodes": alive, "rank_nodes": ranks}))
"""


def _env(token, **extra):
    # the cluster's own token (Ray's token authentication), given to every node and client
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", "RAY_scheduler_spread_threshold": "0",
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": token, **extra}


def _ray_start(token, *args):
    return subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                             "--num-cpus", "2", "--object-store-memory", str(100 * 2**20),
                             *args], env=_env(token), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _cluster_state(cluster):
    out = subprocess.run([sys.executable, "-c", _NODES, cluster["address"]],
                         env=_env(cluster["token"]), timeout=120, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None


@pytest.fixture
def two_nodes():
    import secrets

    temp = tempfile.mkdtemp(prefix="tf-ray2-", dir="/tmp")  # short: Ray's socket paths
    token = os.path.join(temp, "token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    port = free_port()
    nodes = [_ray_start(token, "--head", "--port", str(port), "--temp-dir", temp,
                        "--include-dashboard=false")]
    cluster = {"address": f"127.0.0.1:{port}", "token": token}
    try:
        deadline = time.monotonic() + 180
        while _cluster_state(cluster) is None:  # the head's GCS answers
            assert time.monotonic() < deadline and nodes[0].poll() is None, "ray head did not start"
            time.sleep(1)
        nodes.append(_ray_start(token, "--address", cluster["address"]))
        while len((_cluster_state(cluster) or {}).get("nodes", [])) < 2:
            assert time.monotonic() < deadline and nodes[1].poll() is None, "node 2 did not join"
            time.sleep(1)
        yield cluster
    finally:
        for p in reversed(nodes):  # each node's `ray start --block` stops its own processes
            p.terminate()
        for p in nodes:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_training_across_two_nodes_equals_one_local_process(two_nodes, tmp_path):
    data = str(tmp_path / "e.arrow")
    # the episodes of tests/test_cli_multinode.py (torchrun --nnodes 2): one group per step, so
    # the two ranks share out one tree's bins
    write_episodes(synth_episodes(episodes=8, group_size=4, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6), tool_tokens=(3, 6),
                                  seed=11), data)
    # one process, one torch thread, as each rank actor runs (its matmuls sum in the same order)
    subprocess.run([sys.executable, "-m", "treeflow.cli", "replay", data, *TRAIN, "--save-every",
                    "1", "--save", str(tmp_path / "one"), "--metrics", str(tmp_path / "one.jsonl")],
                   env=_env(two_nodes["token"]), cwd=ROOT, timeout=300, check=True)
    run = subprocess.run([sys.executable, "-m", "treeflow.cli", "replay", data, *TRAIN,
                          "--engine", "ray", "--num-ranks", "2", "--save", str(tmp_path / "two"),
                          "--metrics", str(tmp_path / "two.jsonl")],
                         env=_env(two_nodes["token"], RAY_ADDRESS=two_nodes["address"]),
                         cwd=ROOT, timeout=400,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    state = _cluster_state(two_nodes)
    assert len(state["rank_nodes"]) == 2 and set(state["rank_nodes"]) == set(state["nodes"])
    a, b = ([json.loads(line) for line in open(tmp_path / f"{k}.jsonl")] for k in ("one", "two"))
    assert [r["ranks"] for r in a] == [1, 1] and [r["ranks"] for r in b] == [2, 2]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-6)
        assert x["sampled_tokens"] == y["sampled_tokens"]
    w1, w2 = (load_file(tmp_path / k / "step-000002" / "model.safetensors") for k in ("one", "two"))
    assert w1.keys() == w2.keys()
    for k in w1:
        assert float((w1[k] - w2[k]).abs().max()) <= 1e-6 * float(w1[k].abs().max()), k
    first = load_file(tmp_path / "one" / "step-000001" / "model.safetensors")
    assert max(float((w1[k] - first[k]).abs().max()) for k in w1) > 1e-4  # the steps moved them
    assert torch.isfinite(torch.stack([w.abs().max() for w in w2.values()])).all()
