"""Fixed costs a user pays per command: what the light commands import, and the clock."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from treeflow._clock import process_seconds

_PROBE = textwrap.dedent("""
    import sys
    from treeflow.cli import main
    try:
        rc = main(sys.argv[1:])
    except SystemExit as e:  # --help
        rc = e.code
    heavy = [m for m in ("torch", "ray", "transformers", "megatron") if m in sys.modules]
    print("HEAVY=" + ",".join(heavy))
    sys.exit(rc or 0)
""")


def _heavy(args, cwd):
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1].removeprefix("HEAVY=")


def test_light_commands_import_no_torch_or_ray(tmp_path):
    """synth, inspect and plan never run a model: importing torch cost them ~2 s each."""
    assert _heavy(["synth", "-o", "e.arrow", "--episodes", "8", "--group-size", "4", "--quiet"],
                  tmp_path) == ""
    assert _heavy(["inspect", "e.arrow", "--json"], tmp_path) == ""
    assert _heavy(["plan", "e.arrow", "--max-tokens", "65536", "-o", "b.arrow", "--quiet"],
                  tmp_path) == ""
    assert _heavy(["--help"], tmp_path) == ""


def test_lazy_package_names_resolve_and_unknown_names_fail():
    import treeflow.models as models
    import treeflow.pipeline as pipeline
    import treeflow.stages as stages
    import treeflow.train as train

    for pkg in (stages, pipeline, models, train):
        for name in pkg.__all__:
            value = getattr(pkg, name)  # constants (KERNELS, PRECISIONS) have no __module__
            assert getattr(value, "__module__", pkg.__name__).startswith(pkg.__name__), name
        with pytest.raises(AttributeError, match="no attribute 'Nope'"):
            pkg.Nope  # noqa: B018


def test_process_seconds_counts_interpreter_start(tmp_path):
    """A process that slept before importing treeflow reports at least that sleep."""
    code = "import time; time.sleep(0.6); from treeflow._clock import process_seconds; " \
           "print(process_seconds())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert 0.6 <= float(out.stdout) < 30
    assert process_seconds() > 0


def _synth(path, episodes=4):
    """The tests' data, by `treeflow synth` run here (a process of its own only added a start)."""
    from treeflow.cli import main

    assert main(["synth", "-o", str(path), "--episodes", str(episodes), "--group-size", "2",
                 "--quiet"]) == 0


def test_replay_wall_seconds_count_from_the_process_start(tmp_path):
    """`wall_seconds` is what the user waits: from the process's start (here 1.5 s of sleep
    before treeflow is imported) to the JSON line, as the parent measures it to within 1 s."""
    _synth(tmp_path / "e.arrow")
    argv = ["treeflow", "replay", str(tmp_path / "e.arrow"), "--model", "tiny", "-o",
            str(tmp_path / "lp.arrow"), "--json"]
    code = (f"import runpy, sys, time; time.sleep(1.5); sys.argv = {argv!r}; "
            "runpy.run_module('treeflow.cli', run_name='__main__')")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    parent = time.perf_counter() - t0  # the JSON line has arrived: the run is over
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    row = json.loads(line)
    assert parent + 0.05 >= row["wall_seconds"] >= max(parent - 1.0, 1.5), (parent, row)
    phases = row["phases"]
    assert 1.5 <= phases["imported"] <= phases["engine"] <= phases["loaded"] \
        <= phases["compiled"] <= phases["done"] == row["wall_seconds"]
    assert phases["engine"] <= phases["planned"] <= phases["done"]
    assert row["startup_seconds"] == pytest.approx(phases["engine"] + row["load_seconds"], abs=2e-3)
    assert row["wall_seconds"] == pytest.approx(
        row["startup_seconds"] + row["compile_seconds"] + row["steady_seconds"], abs=3e-3)


_HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "triton", "ray", "transformers", "polars",
          "megatron", "pyarrow.dataset")


def test_cpu_replay_imports_nothing_it_does_not_run(tmp_path):
    """A CPU replay of a checkpoint compiles nothing and reads an Arrow file: no dynamo (meta's
    default init imported it: 2-4 s), inductor, Ray, transformers, polars or pyarrow.dataset,
    and no CUDA initialised."""
    from treeflow.models import ModelConfig, save_model
    from treeflow.models.checkpoint import seeded_decoder

    save_model(seeded_decoder(ModelConfig.tiny()), tmp_path / "ckpt")
    _synth(tmp_path / "e.arrow")
    probe = _PROBE.replace('("torch", "ray", "transformers", "megatron")', repr(_HEAVY)).replace(
        'print("HEAVY="', 'import torch; heavy += ["cuda"] * torch.cuda.is_initialized()\n'
        'print("HEAVY="')
    out = subprocess.run([sys.executable, "-c", probe, "replay", "e.arrow", "--model", "ckpt",
                          "-o", "lp.arrow", "--quiet"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "HEAVY="


def test_finding_a_checkpoint_to_resume_imports_no_distributed_checkpoint(tmp_path):
    """A resume's driver (the Ray engine's, a refused resume's) finds and checks its checkpoint
    without torch.distributed.checkpoint, which only a sharded checkpoint's load needs: its
    import cost each resuming process 2-5 s on the shared machine."""
    from treeflow.stages import Forward, Loss, Reduce
    from treeflow.train import Trainer

    Trainer(Forward(model="tiny"), Reduce(loss=Loss(kind="nll"))).save(str(tmp_path / "ck"))
    code = ("import sys; from treeflow.train.remote import resumed_state; "
            "state = resumed_state(sys.argv[1]); "
            "print(state['steps'], 'torch.distributed.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False"], out.stdout


def _fills(monkeypatch) -> list:
    """Every in-place fill of a tensor (what an initialisation does), by method name."""
    import torch

    calls = []
    for name in ("normal_", "uniform_", "fill_", "zero_", "copy_", "exponential_", "random_"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_model_load_initialises_every_weight_once(tmp_path, monkeypatch):
    """'tiny' draws each parameter once (no default init first); a checkpoint's weights are
    read, never drawn."""
    from treeflow.models import ModelConfig, load_model, save_model

    save_model(load_model("tiny"), tmp_path / "ckpt")
    calls = _fills(monkeypatch)
    model = load_model("tiny")
    assert len(calls) == len(list(model.parameters())), calls
    del calls[:]
    loaded = load_model(str(tmp_path / "ckpt"))
    assert calls == []
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert bool((a == b).all())
    del ModelConfig


def test_entry_runs_exit_handlers_and_flushes_before_its_fast_exit(tmp_path):
    """The console script ends with os._exit: what was printed and registered still happens."""
    code = ("import atexit, sys; atexit.register(lambda: print('handler ran', flush=False)); "
            f"sys.argv = ['treeflow', 'synth', '-o', {str(tmp_path / 'e.arrow')!r}, "
            "'--episodes', '4', '--group-size', '2']; "
            "from treeflow.cli.main import entry; entry()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("handler ran"), out.stdout
    assert (tmp_path / "e.arrow").stat().st_size > 0
    bad = subprocess.run([sys.executable, "-c", code.replace("'4'", "'0'")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "handler ran" in bad.stdout, (bad.returncode, bad.stderr)


def test_entry_does_not_wait_for_inductors_compile_workers(tmp_path):
    """The fast exit leaves inductor's compile-worker shutdown (0.7-0.8 s of waiting on an H200
    host) out of the exit handlers and runs every other one."""
    code = ("import atexit, sys; import torch._inductor.async_compile as ac; "
            "atexit.register(lambda: print('handler ran', flush=False)); "
            "ac.shutdown_compile_workers = (lambda f: (lambda: (print('waited for workers'), "
            "f())))(ac.shutdown_compile_workers); atexit.register(ac.shutdown_compile_workers); "
            f"sys.argv = ['treeflow', 'synth', '-o', {str(tmp_path / 'e.arrow')!r}, "
            "'--episodes', '4', '--group-size', '2']; "
            "from treeflow.cli.main import entry; entry()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "handler ran" in out.stdout and "waited for workers" not in out.stdout, out.stdout


@pytest.mark.ray
def test_ray_replay_asks_for_its_rank_actors_before_the_driver_imports_torch(tmp_path,
                                                                           ray_cluster):
    """`replay --engine ray` reaches its rank actors without torch (about 1 s to import, which
    their own start, torch and model build then overlap); the driver imports it after, for
    the ranks' threads, and its first window is in the summary's phases."""
    import os

    _synth(tmp_path / "e.arrow", episodes=8)
    probe = textwrap.dedent("""
        import json, sys
        import treeflow.train.launch as launch
        asked, seen = launch.rank_actors, []
        def rank_actors(*a, **k):
            seen.append(sorted(m for m in ("torch", "ray.data") if m in sys.modules))
            return asked(*a, **k)
        launch.rank_actors = rank_actors
        from treeflow.cli import main
        rc = main(sys.argv[1:])
        print("SEEN=" + json.dumps(seen))
        sys.exit(rc or 0)
    """)
    # OMP_NUM_THREADS set: the guess is torch's count on any host (without it a hyperthreaded
    # host's guess is wrong, and the actors are rightly asked for a second time)
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
           "OMP_NUM_THREADS": "1"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    out = subprocess.run([sys.executable, "-c", probe, "replay", "e.arrow", "--model", "tiny",
                          "--engine", "ray", "--episodes-per-step", "4", "-o", "lp.arrow",
                          "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-1].removeprefix("SEEN=")) == [[]], lines[-1]
    phases = json.loads(lines[-2])["phases"]
    assert phases["engine"] <= phases["first_window"] <= phases["done"], phases
