"""The one place a policy is built with its environment, for the simulator and the server
alike: the calibration it may read (``CalibrationSource``), its per-request expectations
(``outlook_source``), the KV transfer time between pools (``kv_transfer``), and the
policy itself from the configuration (``policy_env``, ``build_policy``); and the
predictor the server runs on each request (``served_predictor``).

``calibration: auto`` means a profiling run of the scenario in the simulator, which sits
above this module: whoever builds a ``CalibrationSource`` for an ``auto`` configuration
passes the profiler (``olproute.sim.scenario.CalibrationSource`` is the one with the
simulator's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from olproute.config.loader import ConfigError, LoadedConfig
from olproute.estimate.calibration import CalibrationError, InstanceCalibration, read_calibration
from olproute.policies import REGISTRY, Policy, PolicyEnv
from olproute.routing.disagg import KvTransfer
from olproute.routing.outlook import OutlookSource

if TYPE_CHECKING:
    from olproute.predict import Predictor

Profiler = Callable[[LoadedConfig], Sequence[InstanceCalibration]]


class CalibrationSource:
    """The calibration estimating policies use, built on first use and then kept: the
    ``known`` one when given; for ``calibration: auto``, ``profile(loaded)`` (a
    profiling run); otherwise the YAML file of ``olproute calibrate``."""

    def __init__(self, loaded: LoadedConfig,
                 known: Sequence[InstanceCalibration] | None = None,
                 profile: Profiler | None = None) -> None:
        self._loaded = loaded
        self._profile = profile
        self._value: tuple[InstanceCalibration, ...] | None = (
            None if known is None else tuple(known))

    def __call__(self) -> tuple[InstanceCalibration, ...]:
        if self._value is None:
            self._value = self._build()
        return self._value

    def _build(self) -> tuple[InstanceCalibration, ...]:
        loaded = self._loaded
        source = loaded.config.calibration
        if source == "auto":
            if self._profile is None:
                raise ConfigError(loaded.path, [("calibration", "'auto' profiles the "
                                                 "scenario in the simulator, and no "
                                                 "profiler was given; give a calibration "
                                                 "file (olproute calibrate)")])
            return tuple(self._profile(loaded))
        path = loaded.resolve(source)
        try:
            by_name = read_calibration(path)
        except CalibrationError as exc:
            raise ConfigError(loaded.path, [("calibration", str(exc))]) from exc
        missing = [s.name for s in loaded.specs if s.name not in by_name]
        if missing:
            raise ConfigError(loaded.path, [("calibration", f"{path} has no entry for "
                                             f"instance(s) {', '.join(missing)}")])
        return tuple(by_name[s.name] for s in loaded.specs)


def outlook_source(loaded: LoadedConfig) -> OutlookSource:
    """Per-request expectations from the requests' own predictions (made by the
    simulator's workload, or by the server's router as a request arrives)."""
    return OutlookSource(loaded.specs, loaded.profiles)


def served_predictor(loaded: LoadedConfig) -> Predictor | None:
    """The predictor ``olproute serve`` runs on each request (``prediction.serve``), loaded
    and warmed for the pool's models: None for ``max_tokens``; for ``predictor``, the
    folder ``prediction.model_dir`` names (relative to the config file), else the shipped
    one. A folder that does not load is a ConfigError naming the key and the path."""
    pred = loaded.config.prediction
    if pred.serve == "max_tokens":
        return None
    from olproute.predict import SHIPPED_DIR, PoolPredictor, Predictor, PredictorError

    path = SHIPPED_DIR if pred.model_dir is None else loaded.resolve(pred.model_dir)
    try:
        predictor = Predictor.load(path)
    except PredictorError as exc:
        key = "prediction.serve" if pred.model_dir is None else "prediction.model_dir"
        raise ConfigError(loaded.path, [(key, f"cannot load a predictor: {exc}")]) from exc
    PoolPredictor(predictor, [s.model for s in loaded.specs]).warm()
    return predictor


def kv_transfer(loaded: LoadedConfig) -> KvTransfer:
    """The KV transfer time between this configuration's pools (its one model)."""
    model = loaded.profiles.models[loaded.specs[0].model]
    return KvTransfer.of(model, loaded.config.transfer)


def policy_env(loaded: LoadedConfig, name: str, rng: np.random.Generator,
               calibration: CalibrationSource | None = None) -> PolicyEnv:
    """Everything a policy is built from, for this configuration: its parameters
    (``router.policy_params.<name>``), the objective's sections, the slot and horizon,
    the calibration (``calibration``, else one from the config without a profiler), the
    outlook and the KV transfer time."""
    cfg = loaded.config
    return PolicyEnv(
        specs=loaded.specs, rng=rng, params=cfg.router.policy_params.get(name, {}),
        slot_s=cfg.router.slot_ms / 1e3, horizon_slots=cfg.router.horizon_slots,
        reward=cfg.reward, prices=cfg.prices, admission=cfg.admission,
        calibration_source=calibration or CalibrationSource(loaded),
        outlook_source=outlook_source(loaded), transfer_s=kv_transfer(loaded).seconds)


def build_policy(loaded: LoadedConfig, name: str, rng: np.random.Generator,
                 calibration: CalibrationSource | None = None) -> Policy:
    """The named policy, built from this configuration with ``rng`` as its generator."""
    return REGISTRY.create(name, policy_env(loaded, name, rng, calibration))
