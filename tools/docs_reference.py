"""The documentation site's reference pages, generated from the code at every build.

``docs/hooks/reference.py`` (an mkdocs hook) replaces each marker line
``<!-- olproute:reference NAME -->`` of a page with ``render(NAME)``; NAME is one of
``PAGES``:

- ``config``: every key of the run configuration (``olproute.config.schema.Config``) and
  of the profiles file (``Profiles``), by dotted path, with its type, default, bounds and
  description, one table per section (nested models walked);
- ``policies``: every policy of ``olproute.policies.REGISTRY``, its summary and each
  parameter of its typed parameter model;
- ``cli``: every ``olproute`` subcommand and its options, from ``build_parser()``;
- ``http-api``: every path and method of the server's OpenAPI document
  (``olproute.server.schema.openapi``, what ``GET /openapi.json`` serves), its bodies'
  schemas, and the routes the application serves outside the document;
- ``metrics``: every Prometheus metric of ``olproute.server.metrics.ServerMetrics``, from
  the metric objects themselves.

Nothing here is a copy: a key, policy, option, path or metric removed from the code
vanishes from its page at the next build.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

if TYPE_CHECKING:
    from olproute.policies import PolicyRegistry

MARKER = re.compile(r"^<!--\s*olproute:reference\s+([\w-]+)\s*-->[ \t]*$", re.MULTILINE)


class ReferenceError(ValueError):
    """A marker naming no page."""


# -- markdown helpers --------------------------------------------------------------------
def _cell(text: str) -> str:
    """Text fit for one table cell: one line, no column separator outside code."""
    text = " ".join(text.split())
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;")
    return "`".join(parts)


def _code(text: str) -> str:
    tick = "``" if "`" in text else "`"
    pad = " " if tick == "``" else ""
    return f"{tick}{pad}{text}{pad}{tick}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) or " " for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _prose(doc: str | None) -> str:
    """A docstring as markdown: dedented, Sphinx roles (``:class:`X```) as code."""
    text = inspect.cleandoc(doc or "")
    return re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)


def _summary(doc: str | None) -> str:
    """The first paragraph of a docstring, on one line."""
    first = _prose(doc).split("\n\n", 1)[0]
    return " ".join(first.split())


def _value(value: Any) -> str:
    """A default as YAML / JSON flow text."""
    return json.dumps(to_jsonable_python(value), ensure_ascii=False)


# -- the configuration -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Key:
    """One documented key: its dotted path, type, default, bounds and description."""

    path: str
    type: str
    default: str
    bounds: str
    description: str


@dataclass(frozen=True, slots=True)
class Section:
    """One model at a path of the document (``""``: the top level); ``item`` when the
    path is an entry of a list or map."""

    path: str
    model: type[BaseModel]
    keys: tuple[Key, ...]


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _strip(tp: Any) -> tuple[Any, list[Any]]:
    """An annotation without ``Annotated``, and the metadata that was on it."""
    meta: list[Any] = []
    while get_origin(tp) is Annotated:
        args = get_args(tp)
        tp, meta = args[0], meta + list(args[1:])
    return tp, meta


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if get_origin(tp) in (Union, types.UnionType):
        return get_args(tp)
    return None


def type_name(tp: Any) -> str:
    """An annotation as the reference shows it: ``int``, ``list of float``, ``one of
    `a`, `b```, ``float or null``, ``map of str to ...``."""
    tp, _ = _strip(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if _is_model(tp):
        return str(tp.__name__)
    args = _union_args(tp)
    if args is not None:
        names = [type_name(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.append("null")
        return " or ".join(names)
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(_code(str(a)) for a in get_args(tp))
    if origin in (tuple, list, set, frozenset, Sequence):
        items = get_args(tp)
        if origin is tuple and items and items[-1] is not Ellipsis:
            if len(set(items)) == 1:
                return f"list of {len(items)} {type_name(items[0])}"
            return "[" + ", ".join(type_name(a) for a in items) + "]"
        return f"list of {type_name(items[0])}" if items else "list"
    if origin in (dict, Mapping):
        k, v = get_args(tp) or (Any, Any)
        return f"map of {type_name(k)} to {type_name(v)}"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def _constraints(meta: Sequence[Any]) -> list[str]:
    out: list[str] = []
    for m in meta:
        if isinstance(m, FieldInfo):
            out += _constraints(m.metadata)
            continue
        if isinstance(m, at.Ge):
            out.append(f">= {m.ge}")
        if isinstance(m, at.Gt):
            out.append(f"> {m.gt}")
        if isinstance(m, at.Le):
            out.append(f"<= {m.le}")
        if isinstance(m, at.Lt):
            out.append(f"< {m.lt}")
        if isinstance(m, at.MinLen):
            out.append(f"at least {m.min_length} long")
        if isinstance(m, at.MaxLen):
            out.append(f"at most {m.max_length} long")
        pattern = getattr(m, "pattern", None)
        if isinstance(pattern, str):
            out.append("matches " + _code(pattern))
        if getattr(m, "allow_inf_nan", None) is False:
            out.append("finite")
    return out


def bounds(field: FieldInfo) -> str:
    """A field's bounds (``>= 1``, ``> 0``, ``matches `^https?://```, ``finite``), from
    its metadata and that of the types in its annotation."""
    found = _constraints(field.metadata)
    tp, meta = _strip(field.annotation)
    found += _constraints(meta)
    for arg in _union_args(tp) or ():
        found += _constraints(_strip(arg)[1])
    return ", ".join(dict.fromkeys(found))


def default_of(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return "required" if value is PydanticUndefined else _code(_value(value))


def _nested(tp: Any) -> tuple[str, type[BaseModel]] | None:
    """The model a field holds and the path suffix of its entries: ``("", M)`` for a
    model, ``("[]", M)`` for a list of them, ``(".<name>", M)`` for a map of them."""
    tp, _ = _strip(tp)
    for arg in _union_args(tp) or (tp,):
        arg, _ = _strip(arg)
        if _is_model(arg):
            return "", arg
        origin, items = get_origin(arg), get_args(arg)
        if origin in (tuple, list, Sequence) and items and _is_model(_strip(items[0])[0]):
            return "[]", _strip(items[0])[0]
        if origin in (dict, Mapping) and len(items) == 2 and _is_model(_strip(items[1])[0]):
            return ".<name>", _strip(items[1])[0]
    return None


def section_id(path: str, prefix: str = "") -> str:
    """The anchor of a section's heading: ``slo.classes[]`` -> ``slo-classes``."""
    name = re.sub(r"\[\]|\.<name>", "", path).replace(".", "-") or "top-level"
    return f"{prefix}{name}"


def config_sections(model: type[BaseModel], path: str = "", prefix: str = ""
                    ) -> list[Section]:
    """The model's section at ``path`` and those of every model nested in it, in the
    order of the fields: a field holding a model is a section of its own, a list or map
    of models a key (with its default, its type a link to the entries' section) and a
    section for its entries. ``prefix``: of the sections' anchors."""
    keys: list[Key] = []
    below: list[Section] = []
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        kind = type_name(field.annotation)
        nested = _nested(field.annotation)
        if nested is not None:
            suffix, inner = nested
            below += config_sections(inner, key + suffix, prefix)
            if suffix == "" and _union_args(_strip(field.annotation)[0]) is None:
                continue  # a section, not a key
            link = f"[`{key + suffix}`](#{section_id(key + suffix, prefix)})"
            kind = re.sub(rf"\b{inner.__name__}\b", link, kind, count=1)
        keys.append(Key(key, kind, default_of(field), bounds(field), field.description or ""))
    return [Section(path, model, tuple(keys)), *below]


def config_keys(model: type[BaseModel]) -> list[str]:
    """Every key's dotted path, as the page lists them."""
    return [k.path for s in config_sections(model) for k in s.keys]


def _section_md(section: Section, title: str, prefix: str) -> str:
    out = [f"### {title} {{#{section_id(section.path, prefix)}}}", ""]
    doc = _prose(section.model.__doc__) if section.model.__doc__ else ""
    if doc:
        out += [doc, ""]
    out.append(f"*Model:* `{section.model.__module__}.{section.model.__qualname__}`")
    out.append("")
    rows = [[_code(k.path), k.type, k.default, k.bounds, k.description] for k in section.keys]
    if rows:
        out.append(_table(["key", "type", "default", "bounds", "description"], rows))
    else:
        out.append("No keys of its own; its sections follow.")
    return "\n".join(out)


def config_page(model: type[BaseModel], top_title: str = "Top level", prefix: str = ""
                ) -> str:
    """One table per section of ``model``'s document; ``prefix``: of their anchors."""
    parts = []
    for section in config_sections(model, prefix=prefix):
        title = _code(section.path) if section.path else top_title
        parts.append(_section_md(section, title, prefix))
    return "\n\n".join(parts)


def render_config() -> str:
    from olproute.config.schema import Config, Profiles

    return "\n\n".join([
        "## The run configuration", "",
        config_page(Config),
        "## The profiles file",
        "The file the run configuration's `profiles` key names: the models' architectures "
        "and the GPUs' datasheets, by name (`instances[].model` and `instances[].gpu` name "
        "them).",
        config_page(Profiles, "Profiles file, top level", prefix="profiles-"),
    ])


# -- the policies ------------------------------------------------------------------------
def _policy_doc(factory: Callable[..., Any]) -> str | None:
    """The factory's own docstring (a class's is not inherited), else its module's."""
    own = factory.__dict__.get("__doc__") if isinstance(factory, type) else factory.__doc__
    return own or sys.modules[factory.__module__].__doc__


def _policy_summary(factory: Callable[..., Any]) -> str:
    """The docstring's first paragraph; one that leads into a list or formula (ends in a
    colon) says so."""
    text = _summary(_policy_doc(factory))
    return text[:-1] + " (see below)." if text.endswith(":") else text


def params_rows(params: type[BaseModel]) -> list[list[str]]:
    return [[_code(name), type_name(f.annotation), default_of(f), bounds(f),
             f.description or ""] for name, f in params.model_fields.items()]


def policies_page(registry: PolicyRegistry) -> str:
    """A table of the registry's policies, then a section per policy."""
    names = registry.names()
    overview = [[f"[`{n}`](#{n})",
                 "yes" if registry.entry(n).disaggregated else "no",
                 str(len(registry.entry(n).params.model_fields)),
                 _policy_summary(registry.entry(n).factory)] for n in names]
    out = ["## All policies", "",
           _table(["policy", "prefill/decode pools", "parameters", "summary"], overview)]
    for n in names:
        entry = registry.entry(n)
        factory = entry.factory
        out += ["", f"## `{n}` {{#{n}}}", "", _prose(_policy_doc(factory)), "",
                f"*Factory:* `{factory.__module__}.{factory.__qualname__}`; "
                f"*parameters:* `{entry.params.__module__}.{entry.params.__qualname__}`; "
                f"*routes prefill/decode pools:* {'yes' if entry.disaggregated else 'no'}.",
                ""]
        rows = params_rows(entry.params)
        if rows:
            out += [f"Parameters, under `router.policy_params.{n}`:", "",
                    _table(["parameter", "type", "default", "bounds", "description"], rows)]
        else:
            out.append("No parameters.")
    return "\n".join(out)


def render_policies() -> str:
    from olproute.policies import REGISTRY

    return policies_page(REGISTRY)


# -- the command line --------------------------------------------------------------------
def _subcommands(parser: argparse.ArgumentParser
                 ) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand of ``parser``, in the order registered."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _clean(text: str, root: str) -> str:
    """Text without this checkout's absolute paths."""
    return text.replace(root.rstrip("/") + "/", "")


def _help(action: argparse.Action, prog: str) -> str:
    """An option's help with ``%(default)s`` and the like expanded, as argparse does."""
    text = action.help or ""
    if text is argparse.SUPPRESS:
        return ""
    params: dict[str, Any] = dict(vars(action), prog=prog)
    for k, v in list(params.items()):
        if hasattr(v, "__name__"):
            params[k] = v.__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return text % params


def _option_row(action: argparse.Action, prog: str, root: str) -> list[str]:
    names = ", ".join(_code(o) for o in action.option_strings) or _code(action.dest)
    if action.choices is not None:
        value = "one of " + ", ".join(_code(str(c)) for c in action.choices)
    elif action.nargs == 0:
        value = "flag"
    else:
        value = _code(str(action.metavar or action.dest.upper()))
    if isinstance(action, argparse._AppendAction):
        value += " (repeatable)"
    if action.required:
        default = "required"
    elif action.default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0:
        default = ""
    else:
        default = _code(_clean(str(action.default), root))
    return [names, value, default, _clean(_help(action, prog), root)]


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=88)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _command_md(name: str, parser: argparse.ArgumentParser, root: str, level: int) -> str:
    out = [f"{'#' * level} `{name}`", ""]
    if parser.description:
        out += [_clean(parser.description, root), ""]
    out += ["```text", _usage(parser), "```", ""]
    rows = [_option_row(a, parser.prog, root) for a in parser._actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]
    if rows:
        out.append(_table(["option", "value", "default", "description"], rows))
    for sub_name, _, sub in _subcommands(parser):
        out += ["", _command_md(f"{name} {sub_name}", sub, root, level + 1)]
    return "\n".join(out)


def cli_page(parser: argparse.ArgumentParser, root: str = "") -> str:
    subs = list(_subcommands(parser))
    out = ["## Commands", "", _table(["command", "summary"],
                                     [[f"`{parser.prog} {n}`", h] for n, h, _ in subs])]
    for name, _, sub in subs:
        out += ["", _command_md(f"{parser.prog} {name}", sub, root, 2)]
    return "\n".join(out)


def render_cli() -> str:
    from olproute.cli.main import build_parser
    from olproute.config.read import REPO_ROOT

    return cli_page(build_parser(), str(REPO_ROOT))


# -- the HTTP API ------------------------------------------------------------------------
def schema_type(schema: Mapping[str, Any]) -> str:
    """A JSON schema's type in the reference's words."""
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema or "oneOf" in schema:
        alts = [schema_type(s) for s in schema.get("anyOf", schema.get("oneOf", []))]
        alts = [a for a in alts if a != "null"] + (["null"] if "null" in alts else [])
        return " or ".join(dict.fromkeys(alts))
    if "allOf" in schema:
        return " and ".join(schema_type(s) for s in schema["allOf"])
    if "enum" in schema:
        return "one of " + ", ".join(_code(json.dumps(v)) for v in schema["enum"])
    if "const" in schema:
        return _code(json.dumps(schema["const"]))
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(str(k) for k in kind)
    if kind == "array":
        items = schema.get("items")
        return f"array of {schema_type(items)}" if isinstance(items, Mapping) else "array"
    if kind == "object" and isinstance(schema.get("additionalProperties"), Mapping):
        return f"map of string to {schema_type(schema['additionalProperties'])}"
    return str(kind or "any")


def schema_bounds(schema: Mapping[str, Any]) -> str:
    found: list[str] = []
    for s in [schema, *schema.get("anyOf", [])]:
        for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                        ("exclusiveMaximum", "<")):
            if key in s:
                found.append(f"{op} {s[key]}")
        for key, words in (("minLength", "length >="), ("maxLength", "length <="),
                           ("minItems", "items >="), ("maxItems", "items <=")):
            if key in s:
                found.append(f"{words} {s[key]}")
        if "pattern" in s:
            found.append("matches " + _code(str(s["pattern"])))
    return ", ".join(dict.fromkeys(found))


def _schema_md(name: str, schema: Mapping[str, Any]) -> str:
    out = [f"### {name}", ""]
    if schema.get("description"):
        out += [_prose(str(schema["description"])), ""]
    props: Mapping[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", []))
    if props:
        rows = [[_code(k), schema_type(p), "yes" if k in required else "",
                 _code(json.dumps(p["default"])) if "default" in p else "",
                 schema_bounds(p), str(p.get("description", ""))] for k, p in props.items()]
        out.append(_table(["field", "type", "required", "default", "bounds", "description"],
                          rows))
    else:
        out.append(f"Type: {schema_type(schema)}.")
    extra = schema.get("additionalProperties")
    if props and extra is not False:
        out += ["", "Other fields are accepted" + (" and passed on to the backend."
                                                   if extra is True or extra is None else ".")]
    either = [k for alt in schema.get("anyOf", []) if props for k in alt.get("required", [])]
    if either:
        out += ["", "Give at least one of " + ", ".join(_code(k) for k in either) + "."]
    return "\n".join(out)


def _operation_md(path: str, method: str, op: Mapping[str, Any]) -> str:
    out = [f"### `{method.upper()} {path}`", "", _cell(str(op.get("summary", ""))), ""]
    if op.get("description"):
        out += [str(op["description"]), ""]
    if op.get("security"):
        schemes = ", ".join(k for s in op["security"] for k in s)
        out += [f"*Authentication:* {schemes} token.", ""]
    params = op.get("parameters", [])
    if params:
        out += ["Parameters:", "", _table(
            ["name", "in", "type", "bounds", "description"],
            [[_code(p["name"]), p["in"], schema_type(p.get("schema", {})),
              schema_bounds(p.get("schema", {})), str(p.get("description", ""))]
             for p in params]), ""]
    body = op.get("requestBody")
    if body:
        content = body.get("content", {})
        kinds = [f"{schema_type(c.get('schema', {}))} ({t})" for t, c in content.items()]
        need = "required" if body.get("required") else "optional"
        out += [f"*Request body* ({need}): " + ", ".join(kinds), ""]
    rows = []
    for code, answer in op.get("responses", {}).items():
        content = answer.get("content", {})
        shape = ", ".join(f"{schema_type(c.get('schema', {}))} ({t})"
                          for t, c in content.items())
        rows.append([_code(str(code)), str(answer.get("description", "")), shape])
    out.append(_table(["status", "meaning", "body"], rows))
    return "\n".join(out)


def http_page(doc: Mapping[str, Any], served: Sequence[tuple[str, str, str]] = ()) -> str:
    """The OpenAPI document's operations and schemas; ``served``: (method, path, summary)
    of routes the application serves that the document does not list."""
    info = doc.get("info", {})
    out = [f"OpenAPI {doc.get('openapi', '')}, *{info.get('title', '')}* "
           f"{info.get('version', '')}: {info.get('description', '')}", "",
           "## Endpoints", ""]
    ops = [(path, method, op) for path, item in doc.get("paths", {}).items()
           for method, op in item.items()]
    out += [_table(["method", "path", "summary"],
                   [[method.upper(), f"[`{path}`](#{_slug(method, path)})",
                     str(op.get("summary", ""))] for path, method, op in ops]), ""]
    for path, method, op in ops:
        out += [_operation_md(path, method, op), ""]
    if served:
        out += ["## Served outside the OpenAPI document", "",
                _table(["method", "path", "summary"],
                       [[m, _code(p), s] for m, p, s in served]), ""]
    schemas: Mapping[str, Any] = doc.get("components", {}).get("schemas", {})
    if schemas:
        out += ["## Schemas", ""]
        for name, schema in schemas.items():
            out += [_schema_md(name, schema), ""]
    return "\n".join(out).rstrip() + "\n"


def _slug(method: str, path: str) -> str:
    """The id mkdocs' toc gives the heading ``METHOD path`` (in code)."""
    return re.sub(r"[^\w\s-]", "", f"{method} {path}".lower()).strip().replace(" ", "-")


def served_routes(doc: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(method, path, summary) of each route ``olproute.server.app.init_app`` registers
    that ``doc`` does not list (HEAD, which aiohttp adds to every GET, left out); the
    summary names its handler, after its docstring's first paragraph if it has one.
    Built on the default configuration; nothing is started."""
    from olproute.config.loader import load_config
    from olproute.server.app import init_app

    app = init_app(load_config())
    paths: Mapping[str, Any] = doc.get("paths", {})
    out = []
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method == "HEAD" or route.method.lower() in paths.get(path, {}):
            continue
        handler = route.handler
        where = f"`{handler.__module__}.{handler.__qualname__}`"
        first = _summary(handler.__doc__)
        out.append((route.method, path, f"{first} ({where})" if first else where))
    return out


def render_http_api() -> str:
    from olproute.server.schema import openapi

    doc = openapi()
    return http_page(doc, served_routes(doc))


# -- the Prometheus metrics --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Metric:
    """One metric: its family name, type, labels, help, the series it exposes, its
    histogram buckets, and whether it only appears after the first live certificate."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    series: tuple[str, ...]
    buckets: tuple[float, ...]
    lazy: bool


def _wrappers(obj: object) -> dict[str, Any]:
    from prometheus_client.metrics import MetricWrapperBase

    return {m._name: m for m in vars(obj).values() if isinstance(m, MetricWrapperBase)}


def _exposed(registry: Any, wrappers: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Family name -> the names of the series the registry exposes for it, each labelled
    metric given one child (placeholder labels) so that it has samples."""
    for m in wrappers.values():
        if m._labelnames:
            m.labels(*("-" for _ in m._labelnames))
    series: dict[str, list[str]] = {}
    for family in registry.collect():
        names = series.setdefault(family.name, [])
        names += [x.name for x in family.samples if x.name not in names]
    return {k: tuple(v) for k, v in series.items()}


def server_metrics() -> list[Metric]:
    """The metrics of a fresh ``ServerMetrics``, and those it creates at its first
    successful live certificate check (fed one, on a scratch instance), with the series
    its registry then exposes."""
    from olproute.server.metrics import ServerMetrics

    fresh = _wrappers(ServerMetrics())
    after = ServerMetrics()
    after.set_certificate({"status": "ok", "certificate": 0.0, "solve_s": 0.0})
    wrappers = _wrappers(after)
    exposed = _exposed(after.registry, wrappers)
    out = []
    for name, m in sorted(wrappers.items()):
        upper = tuple(b for b in getattr(m, "_upper_bounds", ()) if b != float("inf"))
        out.append(Metric(name, str(m._type), tuple(m._labelnames), str(m._documentation),
                          exposed.get(name, ()), upper, name not in fresh))
    return out


def metrics_page(metrics: Sequence[Metric]) -> str:
    rows = [[_code(m.name), m.type, ", ".join(_code(lb) for lb in m.labels),
             m.help + (" *(exported from the first successful live certificate check)*"
                       if m.lazy else "")] for m in metrics]
    out = ["## All metrics", "", _table(["metric", "type", "labels", "help"], rows), "",
           "## Series exposed", "",
           "`GET /metrics` serves them in Prometheus' text format as these series (a "
           "counter's with `_total`, a histogram's with `_bucket`, `_count` and `_sum`, "
           "`_created`: when a series was created), as the server's registry exposes "
           "them:", "",
           _table(["metric", "series"],
                  [[_code(m.name), ", ".join(_code(s) for s in m.series)] for m in metrics])]
    hists = [m for m in metrics if m.buckets]
    if hists:
        out += ["", "## Histogram buckets", "",
                _table(["metric", "upper bounds (seconds), then +Inf"],
                       [[_code(m.name), ", ".join(f"{b:g}" for b in m.buckets)]
                        for m in hists])]
    return "\n".join(out)


def render_metrics() -> str:
    return metrics_page(server_metrics())


# -- the pages ---------------------------------------------------------------------------
PAGES: dict[str, Callable[[], str]] = {
    "config": render_config,
    "policies": render_policies,
    "cli": render_cli,
    "http-api": render_http_api,
    "metrics": render_metrics,
}


def render(name: str) -> str:
    try:
        page = PAGES[name]
    except KeyError:
        raise ReferenceError(f"no reference page {name!r} (known: "
                             f"{', '.join(sorted(PAGES))})") from None
    return page()


def expand(markdown: str) -> str:
    """The markdown with each marker line replaced by its generated reference."""
    return MARKER.sub(lambda m: render(m.group(1)), markdown)
