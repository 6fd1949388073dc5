"""Routing policies: one interface (``decide`` / ``observe``), registered by name."""

from olproute.policies import baselines as _baselines  # noqa: F401  (registers the baselines)
from olproute.policies.base import (
    REGISTRY,
    Policy,
    PolicyEnv,
    PolicyError,
    PolicyRegistry,
    check_params,
)

__all__ = ["REGISTRY", "Policy", "PolicyEnv", "PolicyError", "PolicyRegistry", "check_params"]
