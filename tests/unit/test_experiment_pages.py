"""The experiment pages (docs/experiments/*.md) quote only what a results file holds.

Every table comes from a results marker (docs/hooks/results.py), which must name an
existing file in bench/results/ and existing keys. Every number written on a page outside
the markers must be *found* in some results file: its figures (``results``) or its
``seeds``. Found means: for a number written with d decimals (thousands separators
dropped), some numeric value v in a file, or v times a conversion factor, printed with
``f"{x:.{d}f}"`` gives the same text; a number written with a sign (+, - or −) must match
v with that sign, one written without matches v or −v (prose says "cuts it by 31.6%" of a
change of −0.316). The factors: 1 for
any number; 100 when the number is followed by ``%`` (a fraction shown as a percentage);
1000 when it is followed by ``ms`` (seconds shown as milliseconds), 1000 and 10⁶ by ``µs``
or ``us`` (milliseconds or seconds shown as microseconds), and 1/1000 by ``s`` (milliseconds
shown as seconds).

Not checked (they are not figures): fenced code blocks and inline code (commands, file
names, config keys), link targets, HTML comments, and digits that are part of a word or a
name (``P99``, ``Llama-2-7B``, ``A100``, ``qwen3-8b``, ``1P+2D``, a range like ``8-16``).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = REPO / "docs" / "experiments"
RESULTS = REPO / "bench" / "results"

NUMBER = re.compile(
    r"(?<![\w.\-/−+])(?P<sign>[+\-−])?(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<frac>\d+))?"
    r"(?![\w\-/]|\.\d|,\d{3})(?P<unit>%|\s?(?:ms|µs|us|s)(?![\w]))?")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\([^)]*\)")
COMMENT = re.compile(r"<!--.*?-->", re.S)
FACTORS = {"": (1.0,), "%": (1.0, 100.0), "ms": (1.0, 1e3), "µs": (1.0, 1e3, 1e6),
           "us": (1.0, 1e3, 1e6), "s": (1.0, 1e-3)}


def hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("results_hook",
                                                  REPO / "docs" / "hooks" / "results.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


HOOK = hook()


def numeric_leaves(x: Any) -> Iterator[float]:
    if isinstance(x, bool) or x is None:
        return
    if isinstance(x, int | float):
        yield float(x)
    elif isinstance(x, dict):
        for v in x.values():
            yield from numeric_leaves(v)
    elif isinstance(x, list):
        for v in x:
            yield from numeric_leaves(v)


def file_values(results_dir: Path) -> frozenset[float]:
    vals: set[float] = set()
    for path in sorted(results_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        vals.update(numeric_leaves(doc.get("results")))
        vals.update(numeric_leaves(doc.get("seeds")))
    return frozenset(vals)


@cache
def printed(values: frozenset[float], decimals: int, factor: float) -> frozenset[str]:
    return frozenset(f"{v * factor:.{decimals}f}" for v in values)


def written_numbers(markdown: str) -> list[tuple[str, str, int, str]]:
    """(as written, the number's text with its sign, decimals, unit) of every number a
    page writes outside markers, code, link targets and comments."""
    text = HOOK.strip_markers(markdown)
    for pattern in (FENCE, COMMENT, CODE, LINK):
        text = pattern.sub(" ", text)
    out = []
    for m in NUMBER.finditer(text):
        sign = "-" if m["sign"] in ("-", "−") else ""
        frac = m["frac"] or ""
        num = sign + m["int"].replace(",", "") + ("." + frac if frac else "")
        out.append((m.group(0).strip(), num, len(frac), (m["unit"] or "").strip()))
    return out


def unfound(markdown: str, values: frozenset[float]) -> list[str]:
    """The numbers of a page that no results file holds (see the module's docstring)."""
    bad = []
    for shown, num, decimals, unit in written_numbers(markdown):
        signs = (num,) if shown[0] in "+-−" else (num, "-" + num)
        if not any(n in printed(values, decimals, f) for n in signs for f in FACTORS[unit]):
            bad.append(shown)
    return bad


def pages() -> list[Path]:
    return sorted(PAGES.glob("*.md"))


def test_there_are_experiment_pages() -> None:
    names = {p.name for p in pages()}
    assert {"index.md", "olp.md", "bear.md", "pd.md", "prefix.md", "lp-and-prices.md",
            "live.md", "replicas.md", "weights.md", "performance.md"} <= names


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_marker_renders_from_an_existing_file_and_key(page: Path) -> None:
    text = page.read_text()
    out = HOOK.render(text)   # ResultsError on a missing file, key or row
    assert HOOK.markers(out) == []
    for mk in HOOK.markers(text):
        assert (RESULTS / mk.file).is_file()


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_number_on_a_page_is_in_a_results_file(page: Path) -> None:
    assert unfound(page.read_text(), file_values(RESULTS)) == []


def _write_results(d: Path, figures: Any) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "t.json").write_text(json.dumps({
        "command": "python bench/t.py --json t.json", "commit": "0" * 40, "seeds": [10, 11],
        "machine": {"cores": 2, "cpu_model": "cpu", "load_avg": [1.0, 1.0, 1.0],
                    "python": "3.11"}, "started": "2026-01-01T00:00:00+00:00", "wall_s": 1.0,
        "results": figures}))


def test_a_made_up_figure_is_reported(tmp_path: Path) -> None:
    _write_results(tmp_path, {"policies": {"bid_price": {"ttft_mean_s": 0.6371,
                                                         "served": 0.9095, "p99_s": 0.4086}}})
    values = file_values(tmp_path)
    page = ("bid_price's mean TTFT 0.637 s, served 92.0% and 90.95%, P99 409 ms on "
            "Llama-2-7B at seed 10; `--requests 4000` is code.\n\n"
            "```\npython bench/t.py --seeds 12345\n```\n")
    assert unfound(page, values) == ["92.0%"]
    made_up = page + "\nIts mean TTFT was 0.512 s, a gain of −12.5%, and 7 of 9 seeds.\n"
    assert unfound(made_up, values) == ["92.0%", "0.512 s", "−12.5%", "7", "9"]
    # a figure inside a rendered marker is not the page's own writing
    marker = ("<!-- results: t.json\nrows: policies\ncolumn: TTFT = ttft_mean_s | .4f\n-->\n")
    assert unfound(marker, values) == []


def test_a_marker_renders_a_table_and_names_what_is_missing(tmp_path: Path) -> None:
    _write_results(tmp_path, {"policies": {"a": {"x": 0.5, "y": None}, "b": {"x": 0.25}}})
    page = ("before\n<!-- results: t.json\nrows: policies\nrow: policy\n"
            "column: X = x | .1%\ncolumn: Y = y | .3f\n-->\nafter\n")
    out = HOOK.render(page, tmp_path)
    assert "| policy | X | Y |" in out and "| `a` | 50.0% | – |" in out
    assert "| `b` | 25.0% | – |" in out
    assert "`python bench/t.py --json t.json`" in out and out.endswith("after\n")
    with pytest.raises(HOOK.ResultsError, match="no results file"):
        HOOK.render(page.replace("t.json", "nope.json"), tmp_path)
    with pytest.raises(HOOK.ResultsError, match="rows"):
        HOOK.render(page.replace("rows: policies", "rows: nothing"), tmp_path)
    with pytest.raises(HOOK.ResultsError, match="no row c"):
        HOOK.render(page.replace("row: policy", "row: policy\nonly: a, c"), tmp_path)
