"""Placeholder for the experiments pages' tables hook: the page as written."""

from __future__ import annotations

from typing import Any


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return markdown
