"""Run a bench as its own process (tests do not import bench/): ``run_bench`` runs
``python bench/NAME.py ARGS`` from the checkout and returns the completed process; a
``--json`` results file's figures are under its ``results`` key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_bench(name: str, *args: str, check: bool = True,
              timeout_s: float = 900.0) -> subprocess.CompletedProcess[str]:
    """``python bench/<name>.py *args`` in the checkout, this interpreter, output captured;
    AssertionError with its stderr when ``check`` and it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def results_of(path: Path) -> Any:
    """The figures of the results file at ``path`` (its ``results``)."""
    return json.loads(path.read_text())["results"]
