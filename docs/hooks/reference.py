"""mkdocs hook: each ``<!-- olproute:reference NAME -->`` line of a page replaced by its
reference, generated from the code at every build (``tools/docs_reference.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    name = "olproute_docs_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "docs_reference.py")
    if spec is None or spec.loader is None:
        raise PluginError("cannot load tools/docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    gen = _generator()
    if not gen.MARKER.search(markdown):
        return markdown
    try:
        return str(gen.expand(markdown))
    except gen.ReferenceError as exc:
        raise PluginError(f"{page.file.src_path}: {exc}") from exc
