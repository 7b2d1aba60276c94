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
