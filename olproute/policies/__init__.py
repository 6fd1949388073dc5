"""Routing policies: one interface (``Policy``: ``decide`` / ``observe`` and optional
hooks), registered by name with a typed parameter model each (``REGISTRY``).

The built-in policies register themselves when their modules are imported, which
``REGISTRY`` does at its first lookup (``PolicyRegistry.load_with``), not this package at
its import: ``olproute.policies.base``, the interface, imports no policy and nothing of
``olproute.pricing`` or JAX (``tests/unit/test_policy_imports.py`` holds it).
"""

from olproute.policies.base import (
    REGISTRY,
    NoParams,
    Policy,
    PolicyEnv,
    PolicyError,
    PolicyParams,
    PolicyRegistry,
    SharedPriceBook,
)

__all__ = ["REGISTRY", "NoParams", "Policy", "PolicyEnv", "PolicyError", "PolicyParams",
           "PolicyRegistry", "SharedPriceBook"]


def _import_builtins() -> None:
    """Import the built-in policies; each registers itself on ``REGISTRY``."""
    from olproute.policies import baselines as _baselines  # noqa: F401

    # the estimating baselines (BEAR paper and Calibrate-then-Route)
    from olproute.policies import bear as _bear  # noqa: F401
    from olproute.policies import bid_price as _bid_price  # noqa: F401
    from olproute.policies import calibrated_cost as _calibrated_cost  # noqa: F401
    from olproute.policies import latency_agnostic as _latency_agnostic  # noqa: F401
    from olproute.policies import lmdeploy as _lmdeploy  # noqa: F401

    # the prefix-cache-aware baselines (SGLang's router, llm-d's scheduler)
    from olproute.policies import prefix_baselines as _prefix_baselines  # noqa: F401
    from olproute.policies import route_balance as _route_balance  # noqa: F401
    from olproute.policies import score as _score  # noqa: F401


REGISTRY.load_with(_import_builtins)
