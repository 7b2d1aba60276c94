"""README's pictures are what scripts/readme_plots.py draws today, from data that is current.

Each picture README shows is one the script writes; each committed PNG carries the digest
of the committed JSON beside it (so the PNG was drawn from that data); and the data the
script computes now, without drawing (a few seconds: synth, inspect's statistics, the
committed benchmark results), equals the committed JSON. A picture left behind after a
change to what its command draws fails here.
"""

import glob
import json
import os
import re
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import readme_plots  # noqa: E402

from treeflow.plots import DIGEST_KEY, data_digest, draw_bins  # noqa: E402


def _committed(png: str) -> dict:
    with open(os.path.join(ROOT, os.path.splitext(png)[0] + ".json")) as f:
        return json.load(f)


def test_every_readme_picture_is_the_scripts_and_was_drawn_from_its_json():
    from PIL import Image

    shown, texts = [], []
    for page in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(
            os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]:
        text = open(page).read()
        texts.append(text)
        for link in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text):  # relative to the page
            shown.append(os.path.relpath(os.path.normpath(os.path.join(
                os.path.dirname(page), link)), ROOT))
    assert sorted(set(shown)) == sorted(readme_plots.PICTURES)
    assert any("scripts/readme_plots.py" in t for t in texts)
    for png in readme_plots.PICTURES:
        record = _committed(png)
        assert record["png"] == os.path.basename(png)
        with Image.open(os.path.join(ROOT, png)) as im:
            assert im.text.get(DIGEST_KEY) == data_digest(record["data"]), \
                f"{png} was not drawn from {os.path.splitext(png)[0]}.json: run " \
                "python scripts/readme_plots.py"


def _same(got, want, where=""):
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
    else:
        assert got == want, where


def test_regenerated_data_equals_the_committed(tmp_path):
    docs = tmp_path / "docs"
    written = readme_plots.regenerate(str(docs), draw=False)
    assert len(written) == len(readme_plots.PICTURES)
    for png in readme_plots.PICTURES:
        here = docs / os.path.basename(png)
        assert not here.exists()  # data only: nothing drawn
        got = json.load(open(os.path.splitext(here)[0] + ".json"))
        _same(got, _committed(png), png)


def test_bins_picture_counts_padding_apart_and_keeps_the_legend_off_the_bars():
    data = _committed("docs/plots/bins.png")["data"]
    tokens = np.asarray(data["tokens"])
    assert data["padding_bins"] == int((tokens == 0).sum())
    used = int((tokens > 0).sum())
    assert data["fill"] == pytest.approx(tokens.sum() / (used * data["max_tokens"]))
    # training's planner (`treeflow plan`'s), not an older one of its own: 6.6% mean rank
    # imbalance over 4 ranks where the older planner showed 34.6% (issue 48)
    assert data["ranks"] == 4 and data["imbalance_mean"] < 0.1
    fig = draw_bins(data)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(canvas.get_renderer())
    for bar in ax.patches:
        assert not legend.overlaps(bar.get_window_extent(canvas.get_renderer()))
    assert legend.x0 >= ax.get_window_extent(canvas.get_renderer()).x1  # beside the plot


def test_call_growth_sums_each_episode_apart():
    """At call turn 0 every episode has run one call, so the median exact-call total equals the
    median chain total, and neither shrinks turn by turn. Calls were numbered by their row in
    their own window, so episodes of different windows were summed as one (exact 1321 against
    chain 920 at turn 0); the regenerated data (the test above) is this committed data."""
    data = _committed("docs/plots/call_growth.png")["data"]
    assert data["exact"][0] == data["chain"][0]
    for key in ("exact", "chain"):
        assert data[key] == sorted(data[key]), key
    assert all(e >= c for e, c in zip(data["exact"], data["chain"]))
