"""Weight profiles: YAML fragments (``configs/weights/*.yaml``, ``olproute tune``'s
``selected.yaml``) merged over a configuration's ``reward``, ``admission`` and ``prices``
sections, key by key.

A profile is a mapping of at most those three sections, each a mapping of some of the
section's keys (``olproute/config/schema.py``: RewardConfig, AdmissionConfig,
PriceConfig, where each key is documented)::

    reward:
      zeta2: 5.0          # bonus when the predicted TTFT meets its threshold
    admission:
      mode: defer

Keys a profile leaves out keep the configuration's values. The merged sections are
validated again; a bad profile raises :class:`ConfigError` naming the profile file and the
key (``configs/weights/x.yaml: reward.zeta2: must be >= 0``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from olproute.config.read import ConfigError, problems_of, read_yaml
from olproute.config.schema import AdmissionConfig, Config, PriceConfig, RewardConfig, key_docs

WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "configs" / "weights"
SECTIONS: dict[str, type[BaseModel]] = {
    "reward": RewardConfig, "admission": AdmissionConfig, "prices": PriceConfig}


def read_profile(path: str | os.PathLike[str], quote: bool = True) -> dict[str, dict[str, Any]]:
    """The sections of a profile file, each key checked against its section (unknown
    keys, wrong types and bounds are errors naming the file and the key). With
    ``quote=False`` (a file a remote caller named) no error quotes the file: an unknown
    section or key is not named, a wrong value not shown, a YAML error gives its line."""
    p = Path(path)
    data = read_yaml(p, quote)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(p, [("", "top level must be a mapping of sections "
                                   f"({', '.join(SECTIONS)})")])
    problems: list[tuple[str, str]] = []
    out: dict[str, dict[str, Any]] = {}
    for name, body in data.items():
        model = SECTIONS.get(str(name))
        if model is None:
            problems.append((str(name) if quote else "", "unknown section (a weight profile "
                             f"may set: {', '.join(SECTIONS)})"))
            continue
        if body is None:
            continue
        if not isinstance(body, Mapping):
            problems.append((str(name), "must be a mapping of keys"))
            continue
        problems += _section_problems(name, model, model().model_dump(), body, quote)
        out[str(name)] = dict(body)
    if problems:
        raise ConfigError(p, list(dict.fromkeys(problems)))
    return out


def _section_problems(name: str, model: type[BaseModel], base: Mapping[str, Any],
                      body: Mapping[str, Any], quote: bool = True) -> list[tuple[str, str]]:
    try:
        model.model_validate({**base, **body})
    except ValidationError as exc:
        return [(f"{name}.{k}" if k else name, m) for k, m in problems_of(exc, quote)]
    return []


def merge_profile(config: Config, profile: Mapping[str, Mapping[str, Any]],
                  path: str | os.PathLike[str], quote: bool = True) -> Config:
    """``config`` with each section of ``profile`` merged over it key by key; the merged
    sections are validated (errors name ``path`` and the key)."""
    updates: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for name, body in profile.items():
        model = SECTIONS[name]
        base = getattr(config, name).model_dump()
        found = _section_problems(name, model, base, body, quote)
        if found:
            problems += found
        else:
            updates[name] = model.model_validate({**base, **body})
    if problems:
        raise ConfigError(path, problems)
    return config.model_copy(update=updates)


def apply_profiles(config: Config, paths: Sequence[str | os.PathLike[str]],
                   quote: bool = True) -> Config:
    """Merge each profile file over ``config``, in order (later files win); ``quote``:
    as for :func:`read_profile`."""
    for path in paths:
        config = merge_profile(config, read_profile(path, quote), path, quote)
    return config


def profile_yaml(sections: Mapping[str, Mapping[str, Any]], header: Sequence[str] = ()) -> str:
    """A profile as YAML text, every key with its documentation (its schema field's
    description) as a comment and the ``header`` lines as comments on top;
    ``read_profile`` reads it back."""
    lines = [f"# {h}" if h else "#" for h in header]
    for name, body in sections.items():
        docs = key_docs(SECTIONS[name]) if name in SECTIONS else {}
        lines.append(f"{name}:")
        for key, value in body.items():
            text = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000)
            text = text.strip()[1:-1].strip()  # "{key: value}" -> "key: value"
            doc = docs.get(key)
            lines.append(f"  {text:<30} # {doc}" if doc else f"  {text}")
    return "\n".join(lines) + "\n"


def profile_names() -> list[str]:
    """The profiles shipped in ``configs/weights``."""
    return sorted(p.stem for p in WEIGHTS_DIR.glob("*.yaml"))


def resolve_profile(name_or_path: str) -> Path:
    """A profile path, or the name of a shipped one (``tail_latency``)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    shipped = WEIGHTS_DIR / f"{name_or_path}.yaml"
    if shipped.exists():
        return shipped
    raise ConfigError(name_or_path, [("", "no such file, and not a shipped weight profile "
                                          f"({', '.join(profile_names())})")])
