"""Loading a run configuration: the YAML file read and validated
(``olproute.config.read``, models in ``olproute.config.schema``), the weight profiles
merged over it (``olproute.config.profiles``), the policy's name and every policy's parameters
checked against the registry (each policy's typed parameter model), and the instances
resolved against the model and GPU profiles.

A bad file raises :class:`ConfigError` whose message names the file and the key path of
every problem, one per line, e.g. ``configs/x.yaml: instances[2].max_num_seqs: must be >=
1`` or ``configs/x.yaml: router.policy_params.bear.form: must be one of 'constrained',
'lagrangian'``. Paths inside a config (the profiles file, traces) are relative to the
config file.

This module sits above the policies (it checks their names and parameters); the policies
and everything below them import the schema and the readers, never this. For the layers
above, it is the configuration's one name: it re-exports the schema and the readers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from olproute.config.profiles import apply_profiles
from olproute.config.read import (
    DEFAULT_CONFIG,
    MAX_YAML_BYTES,
    REPO_ROOT,
    ConfigError,
    load_profiles,
    load_workload,
    prediction_problems,
    read_yaml,
    validate_mapping,
    workload_problems,
)
from olproute.config.schema import (
    AdmissionConfig,
    BackendConfig,
    Config,
    GpuProfile,
    InstanceConfig,
    ModelProfile,
    PredictionConfig,
    PriceConfig,
    Profiles,
    RewardConfig,
    RouterConfig,
    ServerConfig,
    SimConfig,
    SloClassConfig,
    SloConfig,
    TransferConfig,
    WorkloadConfig,
)
from olproute.policies import REGISTRY
from olproute.types import InstanceSpec

GIB = 1024**3

__all__ = [
    "DEFAULT_CONFIG", "GIB", "MAX_YAML_BYTES", "REPO_ROOT", "AdmissionConfig", "BackendConfig",
    "Config", "ConfigError", "GpuProfile", "InstanceConfig", "LoadedConfig", "ModelProfile",
    "PredictionConfig", "PriceConfig", "Profiles", "RewardConfig", "RouterConfig",
    "ServerConfig", "SimConfig", "SloClassConfig", "SloConfig", "TransferConfig",
    "WorkloadConfig", "backend_problems", "instance_specs", "kv_capacity_tokens",
    "load_config", "load_profiles", "load_workload", "policy_problems",
    "prediction_problems", "role_problems", "workload_block_problems", "workload_problems",
]


class LoadedConfig:
    """A validated config with its resolved profiles, instance specs and base folder;
    ``weights``: the weight profiles merged over it (``olproute.config.profiles``), in order."""

    __slots__ = ("base_dir", "config", "path", "profiles", "specs", "weights")

    def __init__(self, path: Path, config: Config, profiles: Profiles,
                 weights: Sequence[Path] = ()) -> None:
        self.path = path
        self.base_dir = path.parent
        self.config = config
        self.profiles = profiles
        self.specs = instance_specs(config, profiles, path)
        self.weights = tuple(weights)

    def with_specs(self, specs: Sequence[InstanceSpec]) -> LoadedConfig:
        """This config with other instance specs (the same instances as their engines
        say they are: ``olproute.server.engine_config``); the config and profiles shared."""
        if [s.name for s in specs] != [s.name for s in self.specs]:
            raise ValueError("with_specs needs the same instances, in order")
        other = object.__new__(LoadedConfig)
        for slot in self.__slots__:
            setattr(other, slot, getattr(self, slot))
        other.specs = tuple(specs)
        return other

    def resolve(self, relative: str) -> Path:
        """A path from the config, relative to the config file's folder."""
        p = Path(relative)
        return p if p.is_absolute() else (self.base_dir / p)

    @property
    def has_workload(self) -> bool:
        """Did the config give a ``workload`` section (or a command set one)?"""
        return "workload" in self.config.model_fields_set

    def require_workload(self, what: str = "this command") -> None:
        """ConfigError naming ``workload`` when the config has none."""
        if not self.has_workload:
            raise ConfigError(self.path, [("workload", f"required: {what} runs the config's "
                                           "workload (only olproute serve needs none)")])

    def with_updates(self, **sections: Any) -> LoadedConfig:
        """A copy with whole sections replaced (``workload=...``, ``router=...``)."""
        return LoadedConfig(self.path, self.config.model_copy(update=sections), self.profiles,
                            self.weights)


def kv_capacity_tokens(inst: InstanceConfig, model: ModelProfile, gpu: GpuProfile) -> int:
    """KV tokens that fit: (memory x utilisation - model weights - activation reserve) per GPU,
    over KV bytes per token per GPU (weights and KV are split by tensor parallelism)."""
    tp = inst.tensor_parallel
    free_per_gpu = (gpu.memory_gib * GIB * inst.gpu_memory_utilization
                    - model.weight_bytes / tp - inst.activation_reserve_gib * GIB)
    if free_per_gpu <= 0:
        return 0
    return int(free_per_gpu // (model.kv_bytes_per_token / tp))


def instance_specs(config: Config, profiles: Profiles, path: Path) -> tuple[InstanceSpec, ...]:
    """Expand replicas and derive KV blocks; errors name the offending instance key."""
    specs: list[InstanceSpec] = []
    problems: list[tuple[str, str]] = []
    names: set[str] = set()
    for i, inst in enumerate(config.instances):
        key = f"instances[{i}]"
        model = profiles.models.get(inst.model)
        gpu = profiles.gpus.get(inst.gpu)
        if model is None:
            problems.append((f"{key}.model", f"unknown model {inst.model!r} "
                             f"(profiles has: {', '.join(sorted(profiles.models))})"))
        if gpu is None:
            problems.append((f"{key}.gpu", f"unknown gpu {inst.gpu!r} "
                             f"(profiles has: {', '.join(sorted(profiles.gpus))})"))
        if model is None or gpu is None:
            continue
        tokens = inst.kv_capacity_tokens or kv_capacity_tokens(inst, model, gpu)
        blocks = tokens // inst.block_size
        if blocks < 1:
            problems.append((key, f"no memory left for the KV cache on {inst.gpu} "
                             f"x{inst.tensor_parallel} with {inst.model}"))
            continue
        for r in range(inst.replicas):
            name = inst.name if inst.replicas == 1 else f"{inst.name}-{r}"
            if name in names:
                problems.append((f"{key}.name", f"duplicate instance name {name!r}"))
            names.add(name)
            specs.append(InstanceSpec(
                name=name, model=inst.model, gpu=inst.gpu,
                tensor_parallel=inst.tensor_parallel, max_num_seqs=inst.max_num_seqs,
                max_num_batched_tokens=inst.max_num_batched_tokens,
                block_size=inst.block_size, num_kv_blocks=blocks, role=inst.role,
                enable_prefix_caching=inst.enable_prefix_caching))
    problems.extend(role_problems(config.instances))
    if problems:
        raise ConfigError(path, problems)
    return tuple(specs)


def role_problems(instances: Sequence[InstanceConfig]) -> list[tuple[str, str]]:
    """Disaggregated pools need both a prefill and a decode instance, no mixed ones
    beside them, and one model (a KV cache only moves between engines of one model)."""
    roles = [inst.role for inst in instances]
    if set(roles) <= {"mixed"}:
        return []
    problems: list[tuple[str, str]] = []
    for i, inst in enumerate(instances):
        if inst.role == "mixed":
            problems.append((f"instances[{i}].role", "a mixed instance cannot sit beside "
                             "prefill/decode pools; give every instance a role of prefill "
                             "or decode, or none"))
    for need in ("prefill", "decode"):
        if need not in roles:
            problems.append(("instances", f"disaggregated pools need at least one {need} "
                             "instance (role: " + need + ")"))
    models = {inst.model for inst in instances}
    if len(models) > 1:
        problems.append(("instances", "disaggregated pools serve one model (the KV cache "
                         f"moves between them); got {', '.join(sorted(models))}"))
    return problems


def workload_block_problems(workload: WorkloadConfig,
                            specs: Sequence[InstanceSpec]) -> list[tuple[str, str]]:
    """A workload whose requests carry block hashes (kind mooncake, or synthetic with
    ``prefix_hashes``) hashes blocks of ``block_tokens``: every instance's blocks must be
    that size, or no hash would name one of its blocks."""
    if workload.kind != "mooncake" and not workload.prefix_hashes:
        return []
    other = sorted({s.block_size for s in specs} - {workload.block_tokens})
    if not other:
        return []
    return [("workload.block_tokens", f"{workload.block_tokens}, but instances have blocks "
             f"of {', '.join(map(str, other))} tokens (instances[].block_size)")]


def load_config(path: str | os.PathLike[str] = DEFAULT_CONFIG,
                weights: Sequence[str | os.PathLike[str]] = (),
                quote: bool = True) -> LoadedConfig:
    """Read, validate and resolve a run configuration and the profiles it names; merge
    the ``weights`` profiles (``olproute.config.profiles``) over its sections, in order.
    ``quote=False`` when a remote caller asks (``POST /admin/reload``): no error prints a
    line of a file (YAML syntax), a value a check refused or a key it made up; key paths
    and the checks' own messages remain."""
    p = Path(path)
    config: Config = validate_mapping(Config, read_yaml(p, quote), p, quote)
    if weights:
        config = apply_profiles(config, weights, quote)
    profiles_path = Path(config.profiles)
    if not profiles_path.is_absolute():
        profiles_path = p.parent / profiles_path
    if not profiles_path.exists():
        raise ConfigError(p, [("profiles", f"file not found: {profiles_path}")])
    # serving replays no workload: a config may leave the section out (the commands that
    # run one say so, ``LoadedConfig.require_workload``)
    problems = (workload_problems(config.workload) if "workload" in config.model_fields_set
                else [])
    problems += prediction_problems(config.prediction, config.workload.kind)
    problems += policy_problems(config.router, quote)
    if problems:
        raise ConfigError(p, problems)
    loaded = LoadedConfig(p, config, load_profiles(profiles_path, quote),
                          tuple(Path(w).resolve() for w in weights))
    problems = backend_problems(config.server, loaded.specs)
    if loaded.has_workload:
        problems += workload_block_problems(config.workload, loaded.specs)
    if problems:
        raise ConfigError(p, problems)
    return loaded


def policy_problems(router: RouterConfig, quote: bool = True) -> list[tuple[str, str]]:
    """The policy is a registered one, and every ``policy_params`` entry names one and
    passes its parameter model (errors keyed ``router.policy_params.<name>.<key>``)."""
    problems = []
    if router.policy not in REGISTRY.names():
        problems.append(("router.policy", f"unknown policy {router.policy!r} "
                         f"(known: {', '.join(REGISTRY.names())})"))
    for name, params in router.policy_params.items():
        key = f"router.policy_params.{name}"
        if name not in REGISTRY.names():
            problems.append((key, "unknown policy"))
            continue
        problems += [(f"{key}.{k}" if k else key, m)
                     for k, m in REGISTRY.param_problems(name, params, quote)]
    return problems


def backend_problems(server: ServerConfig,
                     specs: Sequence[InstanceSpec]) -> list[tuple[str, str]]:
    """Every backend names one instance, once, with that instance's role if it declares
    one; with backends, every instance has one."""
    if not server.backends:
        return []
    names = [s.name for s in specs]
    roles = {s.name: s.role for s in specs}
    problems = []
    seen: set[str] = set()
    for i, b in enumerate(server.backends):
        if b.name not in names:
            problems.append((f"server.backends[{i}].name",
                             f"unknown instance {b.name!r} (instances: {', '.join(names)})"))
        elif b.role is not None and b.role != roles[b.name]:
            problems.append((f"server.backends[{i}].role",
                             f"{b.role!r}, but instance {b.name!r} has role "
                             f"{roles[b.name]!r} (instances[].role)"))
        if b.name in seen:
            problems.append((f"server.backends[{i}].name", f"duplicate backend {b.name!r}"))
        seen.add(b.name)
    missing = [n for n in names if n not in seen]
    if missing and not problems:
        problems.append(("server.backends", f"no backend for instance(s) {', '.join(missing)}"))
    return problems
