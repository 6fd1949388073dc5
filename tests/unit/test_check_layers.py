"""tools/check_layers.py: the repository passes, and a tree that breaks each rule fails
with the offending import (or function) named by file and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "check_layers.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True,
                          text=True, check=False)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_repository_passes() -> None:
    out = _run()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok" in out.stdout


def test_a_cycle_through_an_import_inside_a_function_fails(tmp_path: Path) -> None:
    _write(tmp_path, {
        "olproute/__init__.py": "",
        "olproute/sim/__init__.py": "",
        "olproute/sim/a.py": "from olproute.sim import b\n",
        "olproute/sim/b.py": "def f():\n    from olproute.sim.a import x\n    return x\n",
    })
    out = _run("--root", str(tmp_path))
    assert out.returncode == 1
    assert "import cycle olproute.sim.a -> olproute.sim.b -> olproute.sim.a" in out.stdout
    assert "olproute/sim/a.py:1: olproute.sim.a imports olproute.sim.b" in out.stdout
    assert "olproute/sim/b.py:2: olproute.sim.b imports olproute.sim.a" in out.stdout


def test_an_import_that_climbs_or_goes_sideways_fails(tmp_path: Path) -> None:
    _write(tmp_path, {
        "olproute/__init__.py": "",
        "olproute/types.py": "import olproute.policies.base\n",
        "olproute/policies/__init__.py": "",
        "olproute/policies/base.py": "",
        "olproute/routing/router.py": "from olproute.sim.cluster import Cluster\n",
        "olproute/sim/__init__.py": "",
        "olproute/sim/cluster.py": "Cluster = 1\n",
        "olproute/nowhere.py": "",
    })
    out = _run("--root", str(tmp_path))
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert ("olproute/types.py:1: olproute.types imports olproute.policies.base "
            "(a higher layer)") in lines
    assert ("olproute/routing/router.py:1: olproute.routing.router imports olproute.sim.cluster "
            "(a sibling column of its layer)") in lines
    assert any(line.startswith("olproute.nowhere: in no layer") for line in lines)
    assert not any("cycle" in line for line in lines)


def test_a_long_function_fails(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    _write(tmp_path, {"olproute/__init__.py": "", "olproute/types.py": f"def f():\n{body}"})
    out = _run("--root", str(tmp_path))
    assert out.returncode == 1
    assert "olproute/types.py:1: function f is 81 lines (at most 80)" in out.stdout
    assert _run("--root", str(tmp_path), "--max-lines", "81").returncode == 0


def test_a_long_cdef_function_in_a_pyx_fails(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    pyx = ("# cython: language_level=3\n"
           "cdef double short(double a) noexcept nogil:\n    return a\n\n\n"
           "cdef class K:\n    cdef double v\n\n"
           "    def m(self):\n        cdef double y = float(1)\n        return y\n\n\n"
           "cdef inline int64_t f(double a,\n"
           f"                     double b) noexcept nogil:\n{body}"
           "    # a comment after the body's last line\n\n"
           "cdef int g = max(1, 2)\n")
    _write(tmp_path, {"olproute/__init__.py": "", "olproute/types.py": "",
                      "olproute/_k.pyx": pyx})
    out = _run("--root", str(tmp_path))
    assert out.returncode == 1
    # def line to the body's last line: the two signature lines and 79 of the body
    assert out.stdout.splitlines() == [
        "olproute/_k.pyx:14: function f is 81 lines (at most 80)"], out.stdout
    assert _run("--root", str(tmp_path), "--max-lines", "81").returncode == 0
