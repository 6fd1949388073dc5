"""Check the import structure of olproute/ and solvers/ (docs/design.md section 4: layers only
import downward, no cycles), and the length of their functions.

    python tools/check_layers.py [--root DIR] [--max-lines N]

Three checks, each problem printed on its own line with file and line, exit status 1 if
there is any:

1. **No import cycle** among the modules, counting every import: at module level, inside
   functions and under ``if TYPE_CHECKING:``. ``import a.b.c`` and ``from a.b import c``
   (c a module) are edges to ``a.b.c``; ``from a.b import name`` an edge to ``a.b``. A
   package's own ``__init__`` is not an edge of its submodules' imports (Python runs it,
   but a package that re-exports its submodules would otherwise cycle with each of them).
2. **No import climbs** the layer order below: a module may import modules of a lower
   layer, or of its own layer and column; importing a higher layer, or a sibling column
   of its own layer (``sim`` and ``router`` know nothing of each other), is reported.
3. **No function longer than** ``--max-lines`` (80) lines, ``def`` line to last line: the
   Python modules' (from ``ast``) and the Cython sources' (``.pyx`` and the ``.pxi`` they
   include: ``def``, ``cdef`` and ``cpdef`` functions, found by a line-based scanner,
   ``cython_functions``, since ``ast`` cannot read Cython).

The layer order is ``LAYERS`` below, bottom to top, as docs/design.md (section 4)
states it (types -> kernels, calibration -> bea, predict, config schema -> the policy
interface and the policies that price nothing -> reward -> the price step (NumPy, then
JAX) -> the price book -> the policies that price -> assembly -> sim / router -> server,
solvers -> cli), over the package's concept folders (``estimate``, ``pricing``,
``routing``, ``config``, ``operator``, ...). Each layer is a tuple of columns, each column
a tuple of module names: a name stands for the module and its submodules (``=name`` for
the module alone), and a module belongs to the column with its longest matching name. A
module in no layer is a problem too.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    # the package's own __init__ and its subpackages' (exactly: each holds only its
    # docstring), and the messages every layer speaks
    (("=olproute", "=olproute.estimate", "=olproute.pricing", "=olproute.routing",
      "=olproute.config", "=olproute.operator", "olproute.types"),),
    # running independent calls in worker processes or as Ray tasks (imports nothing of
    # the package) | the router's index of where prompt prefixes were sent or are held,
    # vLLM's KV events on the wire and its block hashes
    (("olproute.operator.executors",), ("olproute.routing.prefix_index",
                                        "olproute.routing.kv_events",
                                        "olproute.routing.block_hash")),
    # the compiled kernels and their twins (batch formation and its Python twin, with
    # vLLM's block pool as the twin of its prefix cache; a decision's arithmetic, whose
    # twin is pricing.reward.score_reference, with the layout of its output; the prompt
    # featuriser; LightGBM's single-row calls)
    (("olproute._core", "olproute.core_ref", "olproute.prefix_ref", "olproute.pricing._score",
      "olproute.pricing.score_fields", "olproute.predict._featurize",
      "olproute.predict._rowheads"),),
    # batch-time calibration (NNLS beta, online refit; from a backend's streams)
    (("olproute.estimate.calibration", "olproute.estimate.streamcal"),),
    # TTFT estimators, load-aware decode durations, predictors, the config schema and
    # what needs only it (reading files, weight profiles, per-request outlook,
    # prefill/decode pools, the live window the exact LP checks, tracked snapshots)
    (("olproute.estimate.bea", "olproute.estimate.decode_load", "olproute.predict",
      "olproute.config.schema",
      "olproute.config.read", "olproute.config.profiles", "olproute.routing.outlook",
      "olproute.routing.disagg", "olproute.routing.live_window", "olproute.routing.tracked"),),
    # the policy interface (it imports nothing of pricing, not even for its types: it
    # reads olproute.types), the registry, and the policies that price nothing
    (("olproute.policies.base", "olproute.policies._common", "olproute.policies.admission",
      "olproute.policies.baselines", "olproute.policies.bear", "olproute.policies.calibrated_cost",
      "olproute.policies.latency_agnostic", "olproute.policies.lmdeploy",
      "olproute.policies.prefix_baselines", "olproute.policies.route_balance",
      "olproute.policies.score"),),
    # the multi-objective reward and usage columns
    (("olproute.pricing.reward",),),
    # shadow prices: the step in NumPy (the reference) and the samples it takes, the jitted
    # step (JAX imported only inside its functions), the book that holds and learns them
    (("olproute.pricing.step_ref",),),
    (("olproute.pricing.step_jax",),),
    (("olproute.pricing.book",),),
    # the policies that price (bid_price, its pools and pairs; a new policy lands here
    # unless listed above), and the package, which imports every policy for the registry
    (("olproute.policies",),),
    # the config loader (policy names and parameters) and the one assembly place
    (("olproute.config.loader", "olproute.routing.assembly"),),
    # the simulator and its CDF plots | the router (no I/O): each builds its policy
    # through the assembly
    (("olproute.sim",), ("olproute.routing.router",)),
    # emulated instances (on the simulator's engine) | offline analysis (tune, its grid,
    # the operator's plots)
    (("olproute.emulator",), ("olproute.operator",)),
    # the HTTP server | the exact LP and its checks | the profiling sweep of live backends
    (("olproute.server",), ("solvers",), ("olproute.estimate.sweep",)),
    # the command line
    (("olproute.cli",),),
)
PACKAGES = ("olproute", "solvers")
MAX_FUNCTION_LINES = 80


@dataclass(frozen=True, slots=True)
class Import:
    """An import of module ``target`` by module ``source``, at ``path``:``line``."""

    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def module_files(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file under the packages (a .pyi stub stands for
    a compiled module without a .py twin)."""
    out: dict[str, Path] = {}
    for pkg in packages:
        files = sorted((root / pkg).rglob("*.py")) + sorted((root / pkg).rglob("*.pyi"))
        for f in files:
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.setdefault(".".join(parts), f)
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name an ``ImportFrom`` names (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    keep = len(base) - node.level + (1 if is_package else 0)
    parts = base[:keep] + ([node.module] if node.module else [])
    return ".".join(parts)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of the modules."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path], root: Path) -> list[Import]:
    """Every import of one of ``modules`` anywhere in ``path`` (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = str(path.relative_to(root))
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path.stem == "__init__", node)
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _known(name, modules)
            if target is not None and target != module:
                found.append(Import(module, target, rel, node.lineno))
    return list(dict.fromkeys(found))  # one per (target, line)


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> list[Import]:
    modules = module_files(root, packages)
    edges: list[Import] = []
    for module, path in modules.items():
        edges += imports_of(module, path, modules, root)
    return edges


def find_cycles(edges: Sequence[Import]) -> list[tuple[set[str], list[Import]]]:
    """Per strongly connected set of modules (each reaches every other by imports): the
    set, and one shortest cycle in it as the imports that close it."""
    graph: dict[str, dict[str, Import]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            cycles.append((component, _cycle_in(graph, component)))
    return cycles


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on long chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.add(top)
                        if top == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, {})))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _cycle_in(graph: dict[str, dict[str, Import]], component: set[str]) -> list[Import]:
    """A shortest cycle through the first module of a strongly connected set (BFS)."""
    start = min(component)
    prev: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target, edge in sorted(graph.get(node, {}).items()):
                if target not in component or target in prev:
                    continue
                prev[target] = edge
                if target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, prev[path[0].source])
                    return path
                nxt.append(target)
        frontier = nxt
    raise AssertionError("a strongly connected set of two or more modules has a cycle")


def layer_of(module: str, layers: Sequence[Sequence[Sequence[str]]] = LAYERS
             ) -> tuple[int, int] | None:
    """(layer, column) of a module: the column with its longest matching name."""
    best: tuple[int, int, int] | None = None
    for i, columns in enumerate(layers):
        for j, names in enumerate(columns):
            for name in names:
                exact = name.startswith("=")
                p = name.lstrip("=")
                hit = module == p or (not exact and module.startswith(p + "."))
                if hit and (best is None or len(p) > best[2]):
                    best = (i, j, len(p))
    return None if best is None else best[:2]


def layer_problems(edges: Sequence[Import], modules: Iterable[str],
                   layers: Sequence[Sequence[Sequence[str]]] = LAYERS) -> list[str]:
    """Modules in no layer, and imports that climb or go sideways."""
    problems = [f"{m}: in no layer of tools/check_layers.py LAYERS" for m in sorted(modules)
                if layer_of(m, layers) is None]
    for e in edges:
        src, dst = layer_of(e.source, layers), layer_of(e.target, layers)
        if src is None or dst is None or dst[0] < src[0] or dst == src:
            continue
        how = "a higher layer" if dst[0] > src[0] else "a sibling column of its layer"
        problems.append(f"{e} ({how})")
    return problems


# a Cython function's first line: ``def name(``, or ``cdef``/``cpdef`` with a return type
# and qualifiers before ``name(`` (no ``=`` before it: a variable declaration's initialiser
# may call a function); ``cdef class``/``struct``/``enum``/``extern`` blocks are not functions
_CYTHON_DEF = re.compile(r"^(?P<indent>[ \t]*)(?:async[ \t]+)?(?P<kind>def|cdef|cpdef)[ \t]"
                         r"(?P<head>[^=(#]*?)\b(?P<name>[A-Za-z_]\w*)[ \t]*\(")
_NOT_FUNCTION = re.compile(r"^[ \t]*c(?:p)?def[ \t]+(?:public[ \t]+|api[ \t]+)*"
                           r"(?:class|struct|union|enum|extern|packed|fused|ctypedef)\b")


def _code_lines(lines: Sequence[str]) -> list[bool]:
    """Per line: whether it holds code that ends or extends a block (not blank, not only
    a comment, not inside a triple-quoted string begun on an earlier line)."""
    out = []
    quote: str | None = None
    for line in lines:
        stripped = line.strip()
        starts_inside = quote is not None
        i = 0
        while i < len(line):
            if quote is None and line[i] == "#":
                break
            for q in ('"""', "'''"):
                if line.startswith(q, i) and quote in (None, q):
                    quote = None if quote == q else q
                    i += 2
                    break
            i += 1
        out.append(not starts_inside and stripped != "" and not stripped.startswith("#"))
    return out


def _indent(line: str) -> int:
    return len(line.expandtabs()) - len(line.expandtabs().lstrip())


def cython_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of each ``def``/``cdef``/``cpdef`` function of a
    Cython source, 1-based: from its ``def`` line to the last code line of its body, the
    body being the lines after the signature indented deeper than the ``def`` line (a
    one-line ``def f(): ...`` is one line)."""
    lines = text.splitlines()
    code = _code_lines(lines)
    out = []
    for n, line in enumerate(lines):
        m = _CYTHON_DEF.match(line)
        if not code[n] or m is None or _NOT_FUNCTION.match(line):
            continue
        # the signature: to the line where its parentheses close, which ends with ":"
        depth, end_sig = 0, n
        for k in range(n, len(lines)):
            body = lines[k].split("#", 1)[0]
            depth += body.count("(") + body.count("[") - body.count(")") - body.count("]")
            end_sig = k
            if depth <= 0:
                break
        tail = lines[end_sig].split("#", 1)[0].rstrip()
        if not tail.endswith(":") and ":" not in tail.rsplit(")", 1)[-1]:
            continue   # a declaration (``cdef int f(int)``), no body
        last = end_sig
        if tail.endswith(":"):   # the body on the lines below
            indent = _indent(line)
            for k in range(end_sig + 1, len(lines)):
                if not code[k]:
                    continue
                if _indent(lines[k]) <= indent:
                    break
                last = k
        out.append((m.group("name"), n + 1, last + 1))
    return out


def cython_files(root: Path, packages: Iterable[str] = PACKAGES) -> list[Path]:
    """The Cython sources under the packages (``.pyx`` and included ``.pxi``)."""
    return [f for pkg in packages for ext in ("*.pyx", "*.pxi")
            for f in sorted((root / pkg).rglob(ext))]


def long_functions(root: Path, packages: Iterable[str] = PACKAGES,
                   max_lines: int = MAX_FUNCTION_LINES) -> list[str]:
    found: list[tuple[Path, str, int, int]] = []
    for path in module_files(root, packages).values():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                found.append((path, node.name, node.lineno, node.end_lineno))
    for path in cython_files(root, packages):
        found += [(path, name, first, last) for name, first, last
                  in cython_functions(path.read_text(encoding="utf-8"))]
    out = []
    for path, name, first, last in found:
        length = last - first + 1
        if length > max_lines:
            out.append(f"{path.relative_to(root)}:{first}: function {name} is {length} lines "
                       f"(at most {max_lines})")
    return out


def check(root: Path, packages: Sequence[str] = PACKAGES,
          layers: Sequence[Sequence[Sequence[str]]] = LAYERS,
          max_lines: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every problem found under ``root``, one line each."""
    edges = import_graph(root, packages)
    problems = []
    for component, cycle in find_cycles(edges):
        names = " -> ".join([cycle[0].source, *(e.target for e in cycle)])
        problems.append(f"import cycle {names} ({len(component)} modules reach each "
                        "other through imports):")
        problems += [f"    {e}" for e in cycle]
    problems += layer_problems(edges, module_files(root, packages), layers)
    problems += long_functions(root, packages, max_lines)
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the repository (default: this tool's)")
    ap.add_argument("--max-lines", type=int, default=MAX_FUNCTION_LINES)
    args = ap.parse_args(argv)
    problems = check(args.root, max_lines=args.max_lines)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"layers, cycles and function lengths: ok ({len(module_files(args.root))} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
