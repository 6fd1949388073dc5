"""MkDocs hook: the experiment pages' tables, rendered from ``bench/results/*.json``.

A page marks a table with an HTML comment (invisible where the hook does not run):

    <!-- results: olp_table.json
    rows: cases[label=overloaded].policies
    row: policy
    only: round_robin, least_outstanding, bid_price
    column: mean EEL vs RR = change_vs_round_robin.mean_eel | +.1%
    column: mean TTFT (s) = mean_ttft_s | .3f
    -->

* ``results: FILE`` (first line): a file in ``bench/results/``.
* ``rows: PATH``: where the rows are in the file's ``results``. A path is dot-separated
  keys; a key of a list is an index (``cases.1``) or a selector ``[field=value]`` that
  takes the list's first item whose ``field`` is ``value`` (``cases[label=overloaded]``).
  A mapping gives one row per key (the row's label); a list gives one row per item, its
  label the item's fields named by ``label:`` (comma-separated, joined by spaces;
  default: its index).
* ``row: TEXT``: the first column's heading (default: empty).
* ``only: a, b``: these rows, in this order (default: every row, in the file's order).
* ``column: HEADING = PATH | FORMAT``: one column per line: PATH within each row, FORMAT a
  Python format spec (``.3f``, ``+.1%``, ``,.0f``; default ``g``), or ``auto``: an
  integer as ``,d``, another number as ``,.1f``. A missing or null value
  (JSON has no inf or NaN) prints ``–``. A PATH of ``.`` is the row itself.
* ``label: FIELD``: see ``rows``.

A marker inside a fenced code block is left alone (a page can show one as an example).

Under the table: the command that wrote the file, its commit, the machine (cores, CPU,
load average at the start, Python) and its wall time. The rendering is pure functions
(``render``, ``render_marker``, ``markers``) so tests call them without MkDocs; this file
imports only the standard library.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"
MARKER = re.compile(r"<!--\s*results:\s*(?P<body>.*?)-->", re.S)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
MISSING = "–"


class ResultsError(ValueError):
    """A marker names a file, a key or an option that is not there."""


@dataclass
class Marker:
    file: str
    rows: str = ""
    row: str = ""
    label: str | None = None
    only: list[str] | None = None
    columns: list[tuple[str, str, str]] = field(default_factory=list)
    span: tuple[int, int] = (0, 0)


def markers(markdown: str) -> list[Marker]:
    """Every results marker of a page, parsed (ResultsError when one is malformed); a
    marker inside a fenced code block is an example, not a marker."""
    out = []
    fences = [f.span() for f in FENCE.finditer(markdown)]
    for m in MARKER.finditer(markdown):
        if any(a <= m.start() < b for a, b in fences):
            continue
        lines = [ln.strip() for ln in m.group("body").strip().splitlines() if ln.strip()]
        if not lines:
            raise ResultsError("a results marker without a file")
        mk = Marker(file=lines[0], span=m.span())
        for ln in lines[1:]:
            key, sep, value = ln.partition(":")
            key, value = key.strip(), value.strip()
            if not sep:
                raise ResultsError(f"{mk.file}: not 'key: value': {ln!r}")
            if key == "rows":
                mk.rows = value
            elif key == "row":
                mk.row = value
            elif key == "label":
                mk.label = value
            elif key == "only":
                mk.only = [v.strip() for v in value.split(",") if v.strip()]
            elif key == "column":
                heading, eq, rest = value.partition("=")
                if not eq:
                    raise ResultsError(f"{mk.file}: column without '=': {ln!r}")
                path, _, fmt = rest.partition("|")
                mk.columns.append((heading.strip(), path.strip(), fmt.strip() or "g"))
            else:
                raise ResultsError(f"{mk.file}: unknown option {key!r}")
        if not mk.columns:
            raise ResultsError(f"{mk.file}: a marker without columns")
        out.append(mk)
    return out


_STEP = re.compile(r"([^.\[\]]+)|\[([^=\]]+)=([^\]]*)\]")


def lookup(doc: Any, path: str) -> Any:
    """The value at a dotted ``path`` (with ``[field=value]`` selectors) in ``doc``;
    KeyError naming the step that is missing."""
    if path in ("", "."):
        return doc
    x = doc
    for m in _STEP.finditer(path):
        name, fld, val = m.groups()
        if name is not None:
            if isinstance(x, dict) and name in x:
                x = x[name]
            elif isinstance(x, list) and name.lstrip("-").isdigit() and -len(x) <= int(
                    name) < len(x):
                x = x[int(name)]
            else:
                raise KeyError(f"{path!r}: no {name!r}")
        else:
            if not isinstance(x, list):
                raise KeyError(f"{path!r}: [{fld}={val}] on a non-list")
            hits = [it for it in x if isinstance(it, dict) and str(it.get(fld)) == val]
            if not hits:
                raise KeyError(f"{path!r}: no item with {fld} = {val}")
            x = hits[0]
    return x


def load(name: str, results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """A results file's document; ResultsError when it is missing or not a results file."""
    path = results_dir / name
    if not path.is_file():
        raise ResultsError(f"no results file {path}")
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or "results" not in doc:
        raise ResultsError(f"{path}: not a results file (no 'results')")
    return doc


def cell(value: Any, fmt: str) -> str:
    if value is None or isinstance(value, dict | list):
        return MISSING
    if isinstance(value, bool | str):
        return str(value)
    if fmt == "auto":   # integers with thousands separators, other numbers to 0.1
        fmt = ",d" if isinstance(value, int) else ",.1f"
    try:
        return format(value, fmt)
    except (TypeError, ValueError) as exc:
        raise ResultsError(f"format {fmt!r} on {value!r}: {exc}") from exc


def provenance(doc: dict[str, Any]) -> str:
    m = doc.get("machine") or {}
    load_avg = m.get("load_avg")
    load_txt = f", load average {load_avg[0]:.2f} at the start" if load_avg else ""
    commit = str(doc.get("commit") or "unknown")
    short = commit[:10] + ("+dirty" if commit.endswith("+dirty") else "")
    return (f"*Written by `{doc.get('command')}` at commit `{short}` on {m.get('cores')} "
            f"cores ({m.get('cpu_model')}){load_txt}, Python {m.get('python')}; "
            f"wall time {doc.get('wall_s')} s, started {doc.get('started')}.*")


def render_marker(mk: Marker, results_dir: Path = RESULTS_DIR) -> str:
    """The markdown table of one marker, its provenance line under it."""
    doc = load(mk.file, results_dir)
    try:
        rows_at = lookup(doc["results"], mk.rows)
    except KeyError as exc:
        raise ResultsError(f"{mk.file}: rows {exc}") from exc
    if isinstance(rows_at, dict):
        rows = [(str(k), v) for k, v in rows_at.items()]
    elif isinstance(rows_at, list):
        fields = [f.strip() for f in (mk.label or "").split(",") if f.strip()]
        rows = [(" ".join(str(v.get(f)) for f in fields)
                 if fields and isinstance(v, dict) else str(i), v)
                for i, v in enumerate(rows_at)]
    else:
        raise ResultsError(f"{mk.file}: rows {mk.rows!r} is neither a mapping nor a list")
    if mk.only is not None:
        by = dict(rows)
        missing = [o for o in mk.only if o not in by]
        if missing:
            raise ResultsError(f"{mk.file}: no row {', '.join(missing)} at {mk.rows!r}")
        rows = [(o, by[o]) for o in mk.only]
    head = [mk.row] + [h for h, _, _ in mk.columns]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join([":---"] + ["---:"] * len(mk.columns)) + "|"]
    for label, row in rows:
        cells = [f"`{label}`"]
        for _, path, fmt in mk.columns:
            try:
                value = lookup(row, path)
            except KeyError:
                value = None
                if mk.only is not None or not isinstance(row, dict):
                    raise ResultsError(f"{mk.file}: row {label!r} has no {path!r}") from None
            cells.append(cell(value, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + provenance(doc) + "\n"


def render(markdown: str, results_dir: Path = RESULTS_DIR) -> str:
    """The page with every results marker replaced by its table."""
    out, last = [], 0
    for mk in markers(markdown):
        out += [markdown[last:mk.span[0]], render_marker(mk, results_dir)]
        last = mk.span[1]
    return "".join(out) + markdown[last:]


def strip_markers(markdown: str) -> str:
    """The page without its markers (what a reader wrote rather than what was rendered)."""
    out, last = [], 0
    for mk in markers(markdown):
        out.append(markdown[last:mk.span[0]])
        last = mk.span[1]
    return "".join(out) + markdown[last:]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs' page event: render the results markers (a missing file or key fails the
    build, naming the page)."""
    if "<!--" not in markdown:
        return markdown
    try:
        return render(markdown)
    except ResultsError as exc:
        where = getattr(getattr(page, "file", None), "src_path", page)
        raise ResultsError(f"{where}: {exc}") from exc
