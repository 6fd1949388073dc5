"""The documentation site's generated reference pages (tools/docs_reference.py, through
docs/hooks/reference.py): each lists what the live objects hold (every config key, policy,
subcommand and option, API operation, metric), and what is taken out of the code leaves
the page; mkdocs.yml loads, and every page of its nav exists."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, get_args, get_origin

import pytest
from markdown.extensions.toc import slugify
from mkdocs.config import load_config
from pydantic import BaseModel, Field, create_model

from olproute.cli.main import build_parser
from olproute.config.schema import Config, Profiles
from olproute.policies import REGISTRY, NoParams, PolicyParams, PolicyRegistry
from olproute.server.metrics import ServerMetrics
from olproute.server.schema import openapi

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# the name the hook loads it under, so both share one module
ref = _load("olproute_docs_reference", REPO / "tools" / "docs_reference.py")

ROW = re.compile(r"^\| `([^`]+)` \| (.*) \|$", re.MULTILINE)


def _rows(page: str) -> dict[str, list[str]]:
    """First cell (a code span) -> the other cells, of every table row of the page."""
    return {m.group(1): [c.strip() for c in re.split(r"(?<!\\) \| ", m.group(2))]
            for m in ROW.finditer(page)}


def _section(page: str, heading: str) -> str:
    """The page's text from ``heading`` to the next heading of the same level."""
    level = heading.split(" ", 1)[0]
    start = page.index(heading + "\n") if heading + "\n" in page else page.index(heading + " ")
    end = page.find(f"\n{level} ", start + len(heading))
    return page[start:] if end < 0 else page[start:end]


# -- config --------------------------------------------------------------------------
def _unwrap(tp: Any) -> Any:
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if get_origin(tp) is not None and type(None) in get_args(tp) else tp


def _leaves(model: type[BaseModel], path: str = "") -> dict[str, Any]:
    """Dotted path -> field, for every key a config file can hold, walked here on its
    own (not with the generator's walk): a model field is a section (an optional one a
    key as well), a list or map of models a key and its entries."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        tp = _unwrap(field.annotation)
        args = get_args(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp is not field.annotation:
                out[key] = field  # an optional section is a key too: it may be null
            out.update(_leaves(tp, key))
            continue
        out[key] = field
        if get_origin(tp) is tuple and args and isinstance(args[0], type) \
                and issubclass(args[0], BaseModel):
            out.update(_leaves(args[0], key + "[]"))
        if get_origin(tp) is dict and isinstance(args[1], type) \
                and issubclass(args[1], BaseModel):
            out.update(_leaves(args[1], key + ".<name>"))
    return out


def test_the_config_page_lists_every_leaf_key_with_its_default_and_description() -> None:
    page = ref.render("config")
    rows = _rows(page)
    leaves = {**_leaves(Config), **_leaves(Profiles)}
    assert len(leaves) > 100  # the whole schema, nested sections included
    for key, field in leaves.items():
        assert key in rows, key
        _type, default, _bounds, description = rows[key]
        assert description == ref._cell(field.description or "").strip(), key
        if field.is_required():
            assert default == "required", key
        else:
            assert default.strip("`") == ref._value(field.get_default(
                call_default_factory=True)), key
    # no row the schema does not have (section rows aside)
    assert set(rows) == set(leaves)


def test_every_leaf_config_key_has_a_description() -> None:
    # the schema is the one place a key is documented: a key added without its
    # description=... fails here, not silently as an empty cell of the reference page
    leaves = {**_leaves(Config), **_leaves(Profiles)}
    undocumented = sorted(k for k, f in leaves.items()
                          if not (f.description and f.description.strip()))
    assert not undocumented, undocumented


def test_the_config_page_shows_bounds_and_types() -> None:
    rows = _rows(ref.render("config"))
    assert rows["instances[].tensor_parallel"][:3] == ["int", "`1`", ">= 1, &lt;= 16"]
    assert rows["workload.rate_per_s"][0] == "float or null"
    assert rows["instances[].role"][0] == "one of `mixed`, `prefill`, `decode`"
    assert "matches `^https?://`" in rows["server.backends[].url"][2]
    assert "finite" in rows["prices.certify_gap_tol"][2]


class _Inner(BaseModel):
    """Inner doc."""

    a: int = Field(default=3, ge=0, description="the a")
    b: str = "x"


class _Root(BaseModel):
    top: float = Field(default=2.0, gt=0, le=5)
    inner: _Inner = _Inner()
    items: tuple[_Inner, ...] = ()
    named: dict[str, _Inner] = Field(default_factory=dict)


def test_a_key_taken_out_of_the_schema_leaves_the_page() -> None:
    page = ref.config_page(_Root)
    rows = _rows(page)
    assert set(rows) == {"top", "inner.a", "inner.b", "items", "items[].a", "items[].b",
                         "named", "named.<name>.a", "named.<name>.b"}
    assert rows["top"] == ["float", "`2.0`", "> 0, &lt;= 5", ""]
    assert rows["inner.a"] == ["int", "`3`", ">= 0", "the a"]
    assert "Inner doc." in _section(page, "### `inner`")

    cut = create_model("_Cut", **{k: (f.annotation, f) for k, f in _Root.model_fields.items()
                                  if k != "top"})
    assert "top" not in _rows(ref.config_page(cut))
    # and on the real schema: the same page without one key of it
    real = create_model("ConfigCut", **{k: (f.annotation, f)
                                        for k, f in Config.model_fields.items()
                                        if k != "calibration"})
    assert "calibration" in _rows(ref.config_page(Config))
    assert "calibration" not in _rows(ref.config_page(real))


# -- policies ------------------------------------------------------------------------
def test_the_policies_page_names_every_registered_policy_and_parameter() -> None:
    page = ref.render("policies")
    assert len(REGISTRY.names()) >= 10
    for name in REGISTRY.names():
        section = _section(page, f"## `{name}`")
        params = REGISTRY.entry(name).params.model_fields
        rows = _rows(section)
        for key, field in params.items():
            assert key in rows, (name, key)
            assert rows[key][-1] == ref._cell(field.description or "").strip()
        if not params:
            assert "No parameters." in section
        assert f"[`{name}`](#{name})" in page  # the overview table


class _FakeParams(PolicyParams):
    knob: float = Field(default=0.5, ge=0, description="how much")


def test_a_policy_taken_out_of_the_registry_leaves_the_page() -> None:
    def fake(env: Any, params: Any) -> Any:
        """A fake policy's summary."""
        raise AssertionError

    with_it, without = PolicyRegistry(), PolicyRegistry()
    with_it.register("fake_policy", _FakeParams)(fake)
    for reg in (with_it, without):
        reg.register("other", NoParams)(fake)
    page = ref.policies_page(with_it)
    assert "## `fake_policy`" in page and "A fake policy's summary." in page
    assert _rows(_section(page, "## `fake_policy`"))["knob"] == [
        "float", "`0.5`", ">= 0", "how much"]
    assert "fake_policy" not in ref.policies_page(without)


# -- cli -----------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def test_the_cli_page_names_every_subcommand_and_option() -> None:
    page = ref.render("cli")
    subs = _subparsers(build_parser())
    assert len(subs) >= 8
    for name, sub in subs.items():
        section = _section(page, f"## `olproute {name}`")
        rows = _rows(section)
        for action in sub._actions:
            if action.option_strings and "--help" not in action.option_strings:
                assert action.option_strings[0] in rows, (name, action.option_strings)
    assert str(REPO) not in page  # no absolute path of this checkout


def test_a_subcommand_taken_out_leaves_the_cli_page() -> None:
    def parser(names: list[str]) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="tool")
        sub = p.add_subparsers(dest="command")
        for n in names:
            s = sub.add_parser(n, help=f"the {n} command")
            s.add_argument("--level", type=int, default=3, help="level (default: %(default)s)")
        return p

    page = ref.cli_page(parser(["alpha", "beta"]))
    assert "## `tool beta`" in page
    assert _rows(_section(page, "## `tool beta`"))["--level"] == [
        "`LEVEL`", "`3`", "level (default: 3)"]
    assert "beta" not in ref.cli_page(parser(["alpha"]))


# -- http api ------------------------------------------------------------------------
def test_the_http_page_lists_every_operation_schema_and_served_route() -> None:
    page = ref.render("http-api")
    doc = openapi()
    for path, item in doc["paths"].items():
        for method in item:
            assert f"### `{method.upper()} {path}`" in page
            # the endpoints table links to the id mkdocs' toc gives that heading
            assert f"(#{slugify(f'{method} {path}', '-')})" in page
    for name in doc["components"]["schemas"]:
        assert f"### {name}\n" in page
    # every route is in the document (test below), so none is listed outside it
    assert "## Served outside the OpenAPI document" not in page


def _app_routes() -> list[tuple[str, str]]:
    """(method, path) of every route ``init_app`` registers on the default configuration
    (HEAD, which aiohttp adds to every GET, left out); nothing is started."""
    from olproute.config.loader import load_config as load_run_config
    from olproute.server.app import init_app

    return [(route.method, route.resource.canonical if route.resource is not None else "")
            for route in init_app(load_run_config()).router.routes()
            if route.method != "HEAD"]


def test_the_openapi_document_lists_every_route_the_app_serves() -> None:
    doc = openapi()
    routes = _app_routes()
    assert ("GET", "/dashboard/data") in routes and ("GET", "/openapi.json") in routes
    missing = [(m, p) for m, p in routes if m.lower() not in doc["paths"].get(p, {})]
    assert not missing, missing
    # and nothing the app does not serve
    documented = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert documented == set(routes)
    # every answer of every operation says what it is
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for code, answer in op["responses"].items():
                assert answer.get("description"), (method, path, code)
    # the content types the handlers answer with
    assert list(doc["paths"]["/dashboard"]["get"]["responses"]["200"]["content"]) == [
        "text/html"]
    for path in ("/dashboard/data", "/openapi.json"):
        assert list(doc["paths"][path]["get"]["responses"]["200"]["content"]) == [
            "application/json"]
    # and the page shows each answer's media type
    rows = _rows(_section(ref.render("http-api"), "### `GET /dashboard`"))
    assert rows["200"][-1] == "string (text/html)"


def test_a_route_left_out_of_the_document_is_listed_as_served_outside_it() -> None:
    doc = openapi()
    del doc["paths"]["/dashboard"]
    served = ref.served_routes(doc)
    assert [(m, p) for m, p, _ in served] == [("GET", "/dashboard")]
    assert "olproute.server.dashboard.page" in served[0][2]
    section = _section(ref.http_page(doc, served), "## Served outside the OpenAPI document")
    assert "| GET | `/dashboard` |" in section


def test_an_operation_taken_out_of_the_document_leaves_the_page() -> None:
    doc = openapi()
    page = ref.http_page(doc)
    assert "### `POST /route`" in page
    del doc["paths"]["/route"]
    cut = ref.http_page(doc)
    assert "### `POST /route`" not in cut and "[`/route`]" not in cut


# -- metrics -------------------------------------------------------------------------
def test_the_metrics_page_names_every_exported_metric_with_its_type() -> None:
    from prometheus_client import generate_latest

    m = ServerMetrics()
    m.set_certificate({"status": "ok", "certificate": 0.0, "solve_s": 0.0})
    text = generate_latest(m.registry).decode()
    exposed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    # the text format names a counter NAME_total, and each counter's and histogram's
    # creation time NAME_created, a gauge of its own
    types = {n.removesuffix("_total") if k == "counter" else n: k
             for n, k in exposed.items()
             if not (n.endswith("_created") and k == "gauge"
                     and {n[:-8] + "_total", n[:-8]} & set(exposed))}
    assert len(types) >= 20
    page = ref.render("metrics")
    rows = _rows(_section(page, "## All metrics"))
    series = _rows(_section(page, "## Series exposed"))
    for name, kind in types.items():
        assert name in rows, name
        assert rows[name][0] == kind, name
        if kind == "counter":
            assert f"`{name}_total`" in series[name][0]
    assert set(rows) == set(types)


def test_a_metric_taken_out_leaves_the_page() -> None:
    metrics = ref.server_metrics()
    assert any(x.lazy for x in metrics)  # the certificate's gauges, created by a check
    page = ref.metrics_page(metrics)
    gone = metrics[0].name
    assert gone in page
    assert gone not in ref.metrics_page(metrics[1:])


# -- the markers, the hook and mkdocs.yml -------------------------------------------
def test_markers_are_replaced_and_an_unknown_one_is_an_error() -> None:
    out = ref.expand("# Metrics\n\n<!-- olproute:reference metrics -->\n\nafter\n")
    assert "olproute:reference" not in out and "## All metrics" in out
    assert out.startswith("# Metrics\n") and out.endswith("after\n")
    with pytest.raises(ref.ReferenceError, match="no reference page 'nope'"):
        ref.expand("<!-- olproute:reference nope -->\n")


def test_every_reference_page_holds_its_marker() -> None:
    pages = sorted((REPO / "docs" / "reference").glob("*.md"))
    assert {p.stem for p in pages} == set(ref.PAGES)
    for p in pages:
        assert ref.MARKER.findall(p.read_text()) == [p.stem], p


def test_mkdocs_yml_loads_and_every_nav_page_exists() -> None:
    cfg = load_config(str(REPO / "mkdocs.yml"))
    docs = Path(cfg["docs_dir"])
    assert docs == REPO / "docs"

    def files(nav: Any) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [f for v in nav.values() for f in files(v)]
        return [f for item in nav for f in files(item)]

    nav = files(cfg["nav"])
    assert len(nav) == 40
    assert "reference/config.md" in nav and "design.md" in nav
    missing = [f for f in nav if not (docs / f).is_file()]
    assert not missing, missing
    # the reference hook is loaded, and expands a page through mkdocs' event
    hook = cfg["hooks"]["docs/hooks/reference.py"]
    page = type("Page", (), {"file": type("File", (), {"src_path": "x.md"})()})()
    assert "## Commands" in hook.on_page_markdown("<!-- olproute:reference cli -->",
                                                   page=page, config=cfg, files=None)
