"""The catalogue's rows for issue 52's config, checkpoint, CLI and data faults (test_catalogue.py
runs them with the same contract: exit 2, one `error:` line naming the file/key/flag, nothing
changed). A row that needs something undone afterwards (a mount, a listening socket, an
environment variable) registers it on CLEANUP, which the test closes after each row.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess

from tests.reliability.helpers import TRAIN, write_small
from treeflow.cli import main

CLEANUP = contextlib.ExitStack()


def _env(**values) -> None:
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

    def restore():
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    CLEANUP.callback(restore)


def _config(tmp, text):
    good = write_small(tmp / "e.arrow")
    (tmp / "run.yaml").write_text(text)
    return good, ["replay", good, *TRAIN, "--config", tmp / "run.yaml"]


def config_rows() -> dict:
    def binary(tmp):
        _, argv = _config(tmp, "steps: 1\nmodel: !!binary dGlueQ==\n")
        return argv, ["run.yaml", "'model'", "!!binary"]

    def laughs(tmp):
        text = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
            for p, c in zip("abcdefgh", "bcdefghi")) + "steps: *i\n"
        _, argv = _config(tmp, text)
        return argv, ["run.yaml", "'a'", "anchor"]

    def duplicate(tmp):
        _, argv = _config(tmp, "steps: 1\nsteps: 2\n")
        return argv, ["run.yaml", "'steps'", "twice"]

    def date(tmp):
        _, argv = _config(tmp, "steps: 1\nsave: 2024-01-01\n")
        return argv, ["run.yaml", "save", "date", "--save"]

    def word(tmp):
        _, argv = _config(tmp, "steps: three\n")
        return argv, ["run.yaml", "steps = 'three'", "--steps"]

    return {"config-yaml-binary": binary, "config-yaml-laughs": laughs,
            "config-yaml-duplicate-key": duplicate, "config-yaml-date": date,
            "config-steps-word": word}


def _checkpoint(tmp):
    """A one-step checkpoint of the small data (written before the row's hashes are taken)."""
    good = write_small(tmp / "e.arrow")
    assert main([str(a) for a in ["replay", good, *TRAIN, "--steps", "1", "--save",
                                  tmp / "ck"]]) == 0
    return good, tmp / "ck", tmp / "ck" / "step-000001"


def _resign(step, name) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    blob = (step / name).read_bytes()
    manifest["files"][name] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))


def checkpoint_rows() -> dict:
    def resume(good, ck):
        return ["replay", good, *TRAIN, "--steps", "2", "--resume", ck]

    def optimizer_nan(tmp):
        from safetensors.torch import load_file, save_file

        good, ck, step = _checkpoint(tmp)
        opt = load_file(step / "optimizer.safetensors")
        key = sorted(k for k in opt if k.endswith("exp_avg_sq"))[0]
        opt[key].view(-1)[0] = float("nan")
        save_file(opt, step / "optimizer.safetensors", metadata={"format": "pt"})
        _resign(step, "optimizer.safetensors")
        return resume(good, ck), ["optimizer.safetensors", f"'{key}'", "non-finite"]

    def betas(tmp):
        good, ck, step = _checkpoint(tmp)
        state = json.loads((step / "trainer.json").read_text())
        state["optimizer"]["param_groups"][0]["betas"] = ["0.9", 0.999]
        (step / "trainer.json").write_text(json.dumps(state))
        _resign(step, "trainer.json")
        return resume(good, ck), ["trainer.json", "param_groups[0].betas"]

    def trainer_deep(tmp):
        good, ck, step = _checkpoint(tmp)
        (step / "trainer.json").write_text("[" * 100_000 + "]" * 100_000)
        _resign(step, "trainer.json")
        return resume(good, ck), ["trainer.json", "nested too deeply"]

    def manifest_deep(tmp):  # the only step: nothing to fall back to (test_checkpoint_faults)
        good, ck, step = _checkpoint(tmp)
        (step / "manifest.json").write_text('{"files": ' + "[" * 100_000 + "]" * 100_000 + "}")
        return resume(good, step), ["step-000001", "manifest.json is unreadable",
                                    "nested too deeply"]

    def manifest_escapes(tmp):
        good, ck, step = _checkpoint(tmp)
        manifest = json.loads((step / "manifest.json").read_text())
        blob = (tmp / "e.arrow").read_bytes()
        manifest["files"]["../../e.arrow"] = {"bytes": len(blob),
                                              "sha256": hashlib.sha256(blob).hexdigest()}
        (step / "manifest.json").write_text(json.dumps(manifest))
        return resume(good, step), ["'../../e.arrow'", "inside the checkpoint"]

    def lr_huge(tmp):
        good = write_small(tmp / "e.arrow")
        return ["replay", good, *TRAIN, "--lr", "1e300"], ["--lr 1e+300", "float32"]

    return {"checkpoint-optimizer-nan": optimizer_nan, "checkpoint-betas-string": betas,
            "checkpoint-trainer-json-deep": trainer_deep,
            "checkpoint-manifest-deep": manifest_deep,
            "checkpoint-manifest-escapes": manifest_escapes, "lr-1e300": lr_huge}


def convert_rows() -> dict:
    def line(tmp, text):
        (tmp / "log.jsonl").write_text(text + "\n")
        return ["convert", tmp / "log.jsonl", "-o", tmp / "c.arrow", "--format", "openai"]

    def duplicate(tmp):
        text = ('{"episode_id": "a", "calls": [{"prompt_token_ids": [1, 2], '
                '"choices": [{"token_ids": [3]}]}], "episode_id": "b"}')
        return line(tmp, text), ["log.jsonl line 1", "'episode_id'", "twice"]

    def neg_inf(tmp):
        text = json.dumps({"episode_id": "a", "calls": [{
            "prompt_token_ids": [1, 2], "choices": [{"token_ids": [3, 4], "logprobs": {
                "token_logprobs": [-0.5, float("-inf")]}}]}]})
        return line(tmp, text), ["log.jsonl line 1", "token_logprobs", "-inf"]

    return {"convert-duplicate-key": duplicate, "convert-neg-inf-logprob": neg_inf}


def tracker_rows() -> dict:
    def wandb_no_key(tmp):
        good = write_small(tmp / "e.arrow")
        (tmp / "home").mkdir()
        _env(WANDB_API_KEY=None, WANDB_MODE=None, HOME=str(tmp / "home"),
             WANDB_DIR=str(tmp / "home"), WANDB_CONFIG_DIR=str(tmp / "home"),
             WANDB_CACHE_DIR=str(tmp / "home"), NETRC=str(tmp / "home" / ".netrc"),
             TREEFLOW_CACHE_DIR=os.environ.get("TREEFLOW_CACHE_DIR") or str(
                 tmp.parent / f"{tmp.name}-cache"))  # the hash cache stays outside tmp
        return ["replay", good, *TRAIN, "--logger", "wandb"], ["--logger wandb", "WANDB_API_KEY"]

    def mlflow_refused(tmp):
        good = write_small(tmp / "e.arrow")
        s = socket.socket()
        s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        CLEANUP.callback(s.close)
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        return ["replay", good, *TRAIN, "--logger", "mlflow", "--mlflow-tracking-uri", uri], \
            ["--logger mlflow", uri, "Connection refused"]

    def mlflow_silent(tmp):  # accepts connections (the kernel's backlog), never answers
        good = write_small(tmp / "e.arrow")
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        CLEANUP.callback(s.close)
        _env(TREEFLOW_TRACKER_TIMEOUT="3")
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        return ["replay", good, *TRAIN, "--logger", "mlflow", "--mlflow-tracking-uri", uri], \
            ["--logger mlflow", "no answer", uri]

    return {"logger-wandb-no-key": wandb_no_key, "logger-mlflow-refused": mlflow_refused,
            "logger-mlflow-silent": mlflow_silent}


def _full_disk(tmp):
    """A full 4 KiB tmpfs at tmp/disk (the tests run as root on CI), unmounted by CLEANUP."""
    disk = tmp / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(disk)], check=True)
    CLEANUP.callback(_unmount, disk)
    with open(disk / "fill", "wb") as f:
        try:
            f.write(b"\0" * 65536)
            f.flush()
        except OSError:
            pass
    return disk


def _unmount(disk) -> None:
    """Unmount; lazily when a file on it is still open (a leaked descriptor: the row fails on
    its own terms, the mount must not outlive the test)."""
    if subprocess.run(["umount", str(disk)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def output_rows() -> dict:
    def metrics_full(tmp):
        good, disk = write_small(tmp / "e.arrow"), _full_disk(tmp)
        return ["replay", good, *TRAIN, "--metrics", disk / "m.jsonl"], \
            ["No space left on device", "m.jsonl", "--metrics"]

    def stream_full(tmp):
        good, disk = write_small(tmp / "e.arrow"), _full_disk(tmp)
        return ["stream", "--from", good, "-o", disk / "o.arrow"], \
            ["No space left on device", "o.arrow", "-o"]

    def tensorboard_full(tmp):
        good, disk = write_small(tmp / "e.arrow"), _full_disk(tmp)
        return ["replay", good, *TRAIN, "--tensorboard", disk / "tb"], \
            ["No space left on device", "tb", "--tensorboard"]

    def metrics_fifo(tmp):
        good = write_small(tmp / "e.arrow")
        fifo = tmp.parent / f"{tmp.name}-m.fifo"  # outside tmp: hashing it would block
        os.mkfifo(fifo)
        CLEANUP.callback(os.remove, fifo)
        return ["replay", good, *TRAIN, "--metrics", fifo], [fifo.name, "not a regular file"]

    def compile_cache_parent(tmp):
        good = write_small(tmp / "e.arrow")
        (tmp / "shared").mkdir()
        os.chmod(tmp / "shared", 0o777)
        return ["replay", good, "-o", tmp / "lp.arrow", "--compile-cache", tmp / "shared" / "cc"], \
            [str(tmp / "shared"), "writable by group or others"]

    def o_under_file(tmp):
        good = write_small(tmp / "e.arrow")
        return ["plan", good, "--max-tokens", "64", "-o", tmp / "e.arrow" / "b.arrow"], \
            ["e.arrow is a file, not a directory"]

    def ref_model_missing(tmp):
        good = write_small(tmp / "e.arrow")
        return ["replay", good, *TRAIN, "--kl-coef", "0.1", "--ref-model", tmp / "ref"], \
            ["--ref-model", "ref", "does not exist"]

    return {"metrics-full-disk": metrics_full, "stream-o-full-disk": stream_full,
            "tensorboard-full-disk": tensorboard_full, "metrics-fifo": metrics_fifo,
            "compile-cache-parent-open": compile_cache_parent, "o-under-a-file": o_under_file,
            "ref-model-missing": ref_model_missing}


def _moe_model(path) -> str:
    """A tiny Qwen3-MoE checkpoint: 1 layer, 4 experts, top-2 (routes of width 2)."""
    from treeflow.models import ModelConfig, load_model, save_model

    d = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=32000, hidden_size=16,
             intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=8)
    save_model(load_model(ModelConfig.from_hf_dict(d)), path)
    return str(path)


def route_rows() -> dict:
    def routed(tmp, token, route):
        import pyarrow as pa

        from tests.reliability.helpers import small_episodes
        from treeflow.schemas import EPISODE_SCHEMA

        rows = small_episodes(4).to_pylist()
        for r in rows:
            for c in r["calls"]:
                c["routed_experts"] = [[1, 2]] * len(c["token_ids"])
        rows[2]["calls"][0]["routed_experts"][token] = route
        with pa.ipc.new_file(tmp / "r.arrow", EPISODE_SCHEMA) as w:
            w.write_table(pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA))
        argv = ["replay", tmp / "r.arrow", "-o", tmp / "o.arrow", "--model", _moe_model(tmp / "moe"),
                "--routing", "replay"]
        return argv, repr(rows[2]["episode_id"])

    def minus_one(tmp):
        argv, episode = routed(tmp, 1, [-1, -1])
        return argv, ["r.arrow", episode, "call 0", "expert id -1 at token 1", "sentinel"]

    def repeated(tmp):
        argv, _ = routed(tmp, 3, [2, 2])
        return argv, ["MoE layer 0", "[2, 2]", "twice"]

    def too_big(tmp):
        argv, _ = routed(tmp, 3, [1, 7])
        return argv, ["MoE layer 0", "[1, 7]", "outside [0, 4)"]

    return {"route-minus-one-inside-a-call": minus_one, "route-expert-twice-in-top-k": repeated,
            "route-expert-id-too-big": too_big}


ROWS = {**config_rows(), **route_rows(), **checkpoint_rows(), **convert_rows(), **tracker_rows(),
        **output_rows()}
