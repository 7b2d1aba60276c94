"""bench/plot_bench.py draws its comparison plots from the committed raw JSON, headless."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plot_bench_writes_pngs(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "plot_bench.py"),
                          "--out", str(tmp_path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "MPLBACKEND": "Agg"})
    report = json.loads(out.stdout)
    assert sorted(os.path.basename(p) for p in report["written"]) == ["memory.png",
                                                                     "speedup_vs_ideal.png"]
    for p in report["written"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(p) > 10_000
    # the plotted points are the raw numbers: the H200 tree forward speedup is bench_gpu.py's own
    raw = json.load(open(os.path.join(ROOT, "bench", "results", "h200_bench_gpu.json")))
    tree = [p for p in report["speedup"] if p["layout"] == "tree" and p["set"].endswith(": forward")]
    assert [p["speedup"] for p in tree] == [raw["layouts"]["tree"]["forward"]["speedup_vs_exact"]]


def test_profiled_cli_counts_overlapping_device_intervals_once(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    from profiled_cli import busy_seconds

    events = [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 10},
              {"ph": "X", "cat": "kernel", "ts": 5, "dur": 10},      # overlaps the first: +5
              {"ph": "X", "cat": "gpu_memcpy", "ts": 20, "dur": 5},  # a gap of 5, then +5
              {"ph": "X", "cat": "kernel", "ts": 21, "dur": 2},      # inside the copy: +0
              {"ph": "X", "cat": "cpu_op", "ts": 30, "dur": 100},    # host work is not busy
              {"ph": "i", "cat": "kernel", "ts": 40}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    busy, count = busy_seconds(str(path))
    assert count == 4 and abs(busy - 20e-6) < 1e-12
