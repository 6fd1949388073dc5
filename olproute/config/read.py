"""Reading configuration files: YAML -> the validated models of
``olproute.config.schema``, with errors that name the file and the key path of every
problem, one per line (``configs/x.yaml: instances[2].max_num_seqs: must be >= 1``), and
the checks across keys of one section. Paths inside a workload file are relative to it.

``olproute.config.loader.load_config`` reads a whole run configuration with these.
"""

from __future__ import annotations

import os
import reprlib
import stat
from collections.abc import Mapping, Sequence, Sized
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from olproute.config.schema import PredictionConfig, Profiles, WorkloadConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


class ConfigError(ValueError):
    """A configuration file is invalid; ``problems`` holds (key path, message) pairs."""

    def __init__(self, path: str | os.PathLike[str], problems: Sequence[tuple[str, str]]):
        self.path = str(path)
        self.problems = list(problems)
        lines = [f"{self.path}: {key}: {msg}" if key else f"{self.path}: {msg}"
                 for key, msg in self.problems]
        super().__init__("\n".join(lines))



_MESSAGES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "missing": "required key is missing",
    "extra_forbidden": "unknown key",
    "too_short": "must have at least {min_length} item(s)",
    "string_too_short": "must not be empty",
    "literal_error": "must be one of {expected}",
    "finite_number": "must be a finite number",
}


def key_path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def problems_of(err: ValidationError, quote: bool = True) -> list[tuple[str, str]]:
    """(key path, message) per problem. ``quote=False`` for a file a remote caller named:
    no value from it and no key it made up appear (an unknown key is reported at its
    parent, a wrong type without the value)."""
    found = (problem(e, quote) for e in err.errors())
    return list(dict.fromkeys(p for p in found if p is not None))


def problem(e: ErrorDetails, quote: bool = True) -> tuple[str, str] | None:
    """(key path, message) of one pydantic error, None when it says nothing of its own."""
    template = _MESSAGES.get(e["type"])
    ctx = e.get("ctx") or {}
    loc = e["loc"]
    if (e["type"] == "too_short" and isinstance(e["input"], Sized)
            and len(e["input"]) >= ctx.get("min_length", 0)):
        # pydantic counts only the items that validated; each bad item already has
        # its own error, so "must have at least 1 item(s)" would be false here.
        return None
    if e["type"] == "extra_forbidden" and not quote:
        loc, msg = loc[:-1], "has an unknown key"
    elif template is not None:
        msg = template.format(**ctx)
    elif e["type"].endswith(("_type", "_parsing")):
        msg = f"{e['msg'][0].lower()}{e['msg'][1:]}"
        msg += f", got {_QUOTE.repr(e['input'])}" if quote else ""
    else:
        msg = e["msg"]
    return key_path(loc), msg


def _quoter() -> reprlib.Repr:
    """Quotes a value in a message: short, and bounded work however large or deeply
    shared (YAML aliases) it is."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, 60, 60, 40
    return r


_QUOTE = _quoter()

MAX_YAML_BYTES = 4 * 1024 * 1024  # a config, profiles or weights file


def _read_text(path: Path) -> str:
    """The text of a regular file of at most MAX_YAML_BYTES. Opened without blocking and
    checked before reading, so a FIFO or a device named as a config is refused, not
    waited on; errors never quote the content."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(path, [("", f"cannot read: {exc.strerror}")]) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(path, [("", "not a regular file")])
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_YAML_BYTES + 1)
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(path, [("", f"larger than {MAX_YAML_BYTES} bytes")])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(path, [("", f"not UTF-8 text (byte {exc.start})")]) from None


def read_yaml(path: Path, quote: bool = True) -> Any:
    """A YAML file's value. ``quote=False`` for a file a remote caller named: a syntax
    error gives its line and column only (PyYAML's message quotes the line)."""
    text = _read_text(path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        if not quote:
            where = "" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: "
            raise ConfigError(path, [("", f"{where}invalid YAML")]) from None
        where = f"line {mark.line + 1}" if mark is not None else "YAML"
        raise ConfigError(path, [("", f"{where}: invalid YAML: {exc}")]) from exc


def validate_mapping(model: type[BaseModel], data: Any, path: Path, quote: bool = True) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(path, [("", "top level must be a mapping of keys")])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(path, problems_of(exc, quote)) from exc


def workload_problems(wl: WorkloadConfig, prefix: str = "workload") -> list[tuple[str, str]]:
    """Checks across workload keys (which keys each kind needs)."""
    problems = []
    if wl.kind in ("trace", "mooncake") and wl.path is None:
        problems.append((f"{prefix}.path", f"required when kind is {wl.kind!r}"))
    if wl.kind == "mooncake" and 512 % wl.block_tokens:
        problems.append((f"{prefix}.block_tokens", "must divide 512, the trace's block of "
                         f"tokens (got {wl.block_tokens})"))
    if wl.kind in ("poisson", "mmpp2"):
        if wl.rate_per_s is None:
            problems.append((f"{prefix}.rate_per_s", f"required when kind is {wl.kind!r}"))
        if wl.num_requests is None and wl.duration_s is None:
            problems.append((f"{prefix}.num_requests", "give num_requests or duration_s"))
        fixed = wl.prompt_tokens is not None and wl.decode_tokens is not None
        if wl.lengths_path is None and not fixed:
            problems.append((f"{prefix}.lengths_path",
                             "give lengths_path or both prompt_tokens and decode_tokens"))
    if wl.prefix_hashes and wl.kind != "synthetic":
        problems.append((f"{prefix}.prefix_hashes", "only kind 'synthetic' has prompt texts "
                         f"to hash, not {wl.kind!r}" + (" (its rows carry their own hashes)"
                                                         if wl.kind == "mooncake" else "")))
    if wl.kind == "synthetic":
        if wl.rate_per_s is None:
            problems.append((f"{prefix}.rate_per_s", "required when kind is 'synthetic'"))
        if wl.num_requests is None and wl.duration_s is None:
            problems.append((f"{prefix}.num_requests", "give num_requests or duration_s"))
    return problems


def prediction_problems(pred: PredictionConfig, workload_kind: str) -> list[tuple[str, str]]:
    """Checks across prediction keys: a predictor needs its folder and prompt text."""
    problems = []
    if pred.mode == "predictor":
        if pred.model_dir is None:
            problems.append(("prediction.model_dir", "required when mode is 'predictor'"))
        if workload_kind != "synthetic":
            problems.append(("prediction.mode", "'predictor' needs prompt text, which only "
                             "workload kind 'synthetic' has"))
    return problems


def load_workload(path: str | os.PathLike[str]) -> WorkloadConfig:
    """A workload section from its own YAML file (a ``workload:`` mapping or a bare one);
    paths inside it are made absolute, relative to that file."""
    p = Path(path)
    data = read_yaml(p)
    prefix = "workload"
    if isinstance(data, Mapping) and "workload" in data:
        data = data["workload"]
    if not isinstance(data, Mapping):
        raise ConfigError(p, [(prefix, "must be a mapping of keys")])
    try:
        workload = WorkloadConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(p, [(f"{prefix}.{k}" if k else prefix, m)
                              for k, m in problems_of(exc)]) from exc
    problems = workload_problems(workload, prefix)
    if problems:
        raise ConfigError(p, problems)
    updates = {k: str((p.parent / v).resolve())
               for k in ("path", "lengths_path") if (v := getattr(workload, k))}
    return workload.model_copy(update=updates)


def load_profiles(path: str | os.PathLike[str], quote: bool = True) -> Profiles:
    p = Path(path)
    result: Profiles = validate_mapping(Profiles, read_yaml(p, quote), p, quote)
    return result

