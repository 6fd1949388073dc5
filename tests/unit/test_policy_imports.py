"""The policy interface stays below pricing: importing ``olproute.policies.base`` (and so
the ``olproute.policies`` package) in a fresh interpreter loads no pricing module, no
policy and no JAX; the registry's first lookup then imports the built-in policies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import olproute.policies.base
before = sorted(sys.modules)
from olproute.policies import REGISTRY
names = REGISTRY.names()
print(json.dumps({"before": before, "after": sorted(sys.modules), "names": names}))
"""


def _probe() -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, cwd=REPO)
    result: dict[str, list[str]] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_the_policy_interface_imports_no_pricing_and_no_jax() -> None:
    got = _probe()
    before = set(got["before"])
    pricing = sorted(m for m in before if m.startswith("olproute.pricing"))
    assert pricing == [], f"olproute.policies.base imports {pricing}"
    assert not {m for m in before if m == "jax" or m.startswith("jax.")}
    policies = sorted(m for m in before if m.startswith("olproute.policies."))
    assert policies == ["olproute.policies.base"]
    # the first lookup registers every built-in policy (and prices only then)
    assert "bid_price" in got["names"] and "round_robin" in got["names"]
    assert "olproute.pricing.book" in got["after"]
