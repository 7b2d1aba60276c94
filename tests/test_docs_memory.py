"""The planned memory numbers that README.md, docs/index.md and docs/how-to/memory.md quote
equal what `treeflow plan --memory` prints for the command each one names.

A planned number is written in one of two forms, both for a reader first:
- a row of a Markdown table whose header has a `config` and a `flags` column: the config cell
  links a config.json under docs/how-to/configs/ (an empty cell repeats the row above), the
  flags cell is one code span of `plan --memory` flags; the columns `planned peak a rank
  (GiB)`, `peak at`, `largest --max-tokens` and the components (`weights`, `weight casts`,
  `gradients`, `AdamW`, `activations`, `temporaries`) are compared, other columns (measured
  numbers, the record of a bench run) are left alone;
- inline, `planned X GiB a rank` after a link to the config and a code span of its flags on
  the same line (README's memory row).
Every command runs with `--device-memory 79.2GiB` (an H100 80GB's usable memory, the card the
pages plan for). A number matches when the planner's value, rounded to the digits the page
shows, is the page's text; `largest --max-tokens` must be exact (`none` for 0). The refusal
and the `--recompute auto` line the page quotes are compared whole. The planner is arithmetic
on a config (no model loads), so this costs well under a second a row. The trade-off: the page
may round, and a change below its last digit passes (the exact `largest --max-tokens` of every
fitting row is what catches a small term).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from treeflow.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "docs" / "how-to" / "configs"
PAGES = ("README.md", "docs/index.md", "docs/how-to/memory.md")
CARD = "79.2GiB"
# header cell -> how to read the planner's JSON for it
GIB = {"weights": "weights", "weight casts": "weight_casts", "gradients": "gradients",
       "AdamW": "optimizer", "activations": "activations", "temporaries": "temporaries"}
PEAK, AT, LARGEST = "planned peak a rank (GiB)", "peak at", "largest `--max-tokens`"
CONFIG_LINK = re.compile(r"\]\(([^)\s]*configs/([\w.-]+\.json))\)")
FLAGS = re.compile(r"`(--[^`]+)`")
INLINE = re.compile(r"planned (\d+(?:\.\d+)?) GiB a rank")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_rows(page: str) -> list[tuple[int, str, str, dict]]:
    """(line number, config file name, flags, {column: shown text}) of every planned table row."""
    rows, header, config = [], None, None
    for n, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line.replace("\\|", "/"))
        if header is None:
            header, config = cells, None
            continue
        if set(cells) <= {"---"} or "config" not in header or "flags" not in header:
            continue
        row = dict(zip(header, (c.replace("**", "") for c in cells)))
        link = CONFIG_LINK.search(row["config"])
        config = link.group(2) if link else config
        flags = FLAGS.fullmatch(row["flags"])
        assert config and flags, f"{page}:{n}: a planned row needs its config link and flags"
        rows.append((n, config, flags.group(1), row))
    return rows


def inline_numbers(page: str) -> list[tuple[int, str, str, str]]:
    """(line number, config, flags, shown GiB) of every inline `planned X GiB a rank`."""
    out = []
    for n, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        for m in INLINE.finditer(line):
            before = line[:m.start()]
            links, flags = CONFIG_LINK.findall(before), FLAGS.findall(before)
            assert links and flags, (f"{page}:{n}: 'planned {m.group(1)} GiB a rank' without a "
                                     "config link and a code span of flags before it on its line")
            out.append((n, links[-1][1], flags[-1], m.group(1)))
    return out


_PLANS: dict = {}


def plan(config: str, flags: str) -> dict:
    key = (config, flags)
    if key not in _PLANS:
        argv = ["plan", "--memory", "--model", str(CONFIGS / config), *flags.split(),
                "--device-memory", CARD, "--json"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(argv) == 0, argv
        _PLANS[key] = json.loads(out.getvalue().strip().splitlines()[-1])
    return _PLANS[key]


def _same(shown: str, value: float) -> bool:
    digits = len(shown.split(".")[1]) if "." in shown else 0
    return f"{value:.{digits}f}" == shown


def mismatches(page: str) -> list[str]:
    """Every planned number of `page` the planner disagrees with, as 'page:line: ...'."""
    bad = []
    for n, config, flags, row in table_rows(page):
        p = plan(config, flags)
        want = {PEAK: p["total_bytes"] / 2**30, AT: p["peak_at"],
                LARGEST: p["largest_max_tokens"],
                **{col: p["bytes"][key] / 2**30 for col, key in GIB.items()}}
        for col, shown in row.items():
            if col not in want or shown == "":
                continue
            got = want[col]
            if col == AT:
                ok = shown == got
            elif col == LARGEST:
                ok = shown.replace(",", "") == (str(got) if got else "none")
            else:
                ok = _same(shown, got)
            if not ok:
                bad.append(f"{page}:{n}: {config} `{flags}`: {col} shows {shown}, the planner "
                           f"gives {got}")
    for n, config, flags, shown in inline_numbers(page):
        got = plan(config, flags)["total_bytes"] / 2**30
        if not _same(shown, got):
            bad.append(f"{page}:{n}: {config} `{flags}`: planned {shown} GiB a rank, the "
                       f"planner gives {got}")
    return bad


def test_every_planned_number_is_the_planners():
    """Each page's planned numbers, rerun; the rows counted, so a table the parser stops
    seeing (a renamed column) fails here instead of passing unchecked."""
    counts = {page: len(table_rows(page)) + len(inline_numbers(page)) for page in PAGES}
    assert counts["README.md"] == counts["docs/index.md"] == 2, counts
    assert counts["docs/how-to/memory.md"] >= 35, counts
    bad = [b for page in PAGES for b in mismatches(page)]
    assert not bad, "\n".join(bad)


def _quoted(page: str, start: str) -> tuple[str, str, str]:
    """(config, flags, the quoted text) of the block or code span starting with `start`: the
    config link and flags are the last ones on the lines before it."""
    text = (ROOT / page).read_text()
    at = text.index(start)
    before = text[:at]
    config = CONFIG_LINK.findall(before)[-1][1]
    flags = FLAGS.findall(before[before.rindex("configs/"):])[-1]
    end = text.index("```" if text[at - 1] == "\n" else "`", at)
    return config, flags, " ".join(text[at:end].split())


def test_the_quoted_refusal_and_auto_line_are_the_planners():
    """The page's example refusal is what `replay --mode train` raises for the command it
    names (cli/memory.check_fits, the same call), and its auto line what plan --memory's
    `recompute_auto` says for that config."""
    from treeflow.cli.main import build_parser
    from treeflow.cli.memory import check_fits

    page = "docs/how-to/memory.md"
    config, flags, quoted = _quoted(page, "error: --mode train: the predicted peak")
    args = build_parser().parse_args(["plan", "--memory", "--model", str(CONFIGS / config),
                                      *flags.split()])
    with pytest.raises(ValueError) as e:
        check_fits(args, recompute=args.recompute)
    assert quoted == "error: " + " ".join(str(e.value).replace(str(CONFIGS / config),
                                                                config).split())
    config, flags, quoted = _quoted(page, "treeflow: --recompute auto: ")
    chosen = plan(config, flags + " --recompute auto")["recompute_auto"]
    assert quoted == f"treeflow: --recompute auto: {chosen}"
