"""YAML -> validated, frozen configuration objects.

A bad file raises :class:`ConfigError` whose message names the file and the key path of
every problem, one per line, e.g. ``configs/x.yaml: instances[2].max_num_seqs: must be >= 1``.
Paths inside a config (the profiles file, traces) are relative to the config file.
"""

from __future__ import annotations

import os
import reprlib
import stat
from collections.abc import Mapping, Sequence, Sized
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from olproute.types import InstanceSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"
GIB = 1024**3


class ConfigError(ValueError):
    """A configuration file is invalid; ``problems`` holds (key path, message) pairs."""

    def __init__(self, path: str | os.PathLike[str], problems: Sequence[tuple[str, str]]):
        self.path = str(path)
        self.problems = list(problems)
        lines = [f"{self.path}: {key}: {msg}" if key else f"{self.path}: {msg}"
                 for key, msg in self.problems]
        super().__init__("\n".join(lines))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- profiles -------------------------------------------------------------------------
class ModelProfile(_Frozen):
    """Architecture of one model, as in its config.json."""

    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    num_params: float = Field(gt=0)
    bytes_per_param: float = Field(default=2.0, gt=0)
    kv_bytes_per_element: float = Field(default=2.0, gt=0)
    max_context_tokens: int = Field(ge=1)
    # serving prices, USD per million tokens (0 when unknown: no cost term)
    price_input_per_mtok: float = Field(default=0.0, ge=0)
    price_output_per_mtok: float = Field(default=0.0, ge=0)

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes one token occupies across all layers (K and V), whole model."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element


class GpuProfile(_Frozen):
    """One GPU: datasheet peaks plus the achievable fractions used by the roofline."""

    peak_bf16_flops: float = Field(gt=0)
    hbm_bandwidth_bytes_per_s: float = Field(gt=0)
    memory_gib: float = Field(gt=0)
    interconnect_bytes_per_s: float = Field(gt=0)
    interconnect_latency_s: float = Field(ge=0)
    compute_efficiency: float = Field(gt=0, le=1)
    memory_efficiency: float = Field(gt=0, le=1)


class Profiles(_Frozen):
    models: dict[str, ModelProfile]
    gpus: dict[str, GpuProfile]


# -- the run configuration ---------------------------------------------------------------
class InstanceConfig(_Frozen):
    """One serving instance (or ``replicas`` identical ones), with vLLM's engine limits."""

    name: str = Field(min_length=1)
    model: str
    gpu: str
    tensor_parallel: int = Field(default=1, ge=1, le=16)
    replicas: int = Field(default=1, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    block_size: int = Field(default=16, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    activation_reserve_gib: float = Field(default=1.0, ge=0)
    kv_capacity_tokens: int | None = Field(default=None, ge=1)
    # mixed serves both phases; prefill / decode instances form disaggregated pools
    role: Literal["mixed", "prefill", "decode"] = "mixed"


class WorkloadConfig(_Frozen):
    """Arrivals and lengths.

    ``poisson`` / ``mmpp2`` generate arrivals at ``rate_per_s`` (MMPP-2 with rate ratio
    ``ratio``) and take lengths from ``lengths_path`` (a trace or lengths-only CSV,
    shuffled) or the fixed ``prompt_tokens`` / ``decode_tokens``. ``trace`` replays
    ``path`` with its own arrivals, stretched by ``time_scale`` or rescaled to
    ``rate_per_s`` when given. ``start_s`` / ``duration_s`` cut a window of a trace.
    ``synthetic`` generates prompts with text and per-model truth (``olproute.sim.prompts``)
    arriving at mean rate ``rate_per_s``, as a Poisson process or, with ``arrivals:
    mmpp2``, an MMPP-2 with rate ratio ``ratio`` (BEAR paper App. B).
    """

    kind: Literal["poisson", "mmpp2", "trace", "synthetic"] = "trace"
    arrivals: Literal["poisson", "mmpp2"] = "poisson"  # arrival process of kind synthetic
    rate_per_s: float | None = Field(default=None, gt=0)
    ratio: float = Field(default=3.0, ge=1)
    num_requests: int | None = Field(default=None, ge=1)
    path: str | None = None
    lengths_path: str | None = None
    prompt_tokens: int | None = Field(default=None, ge=1)
    decode_tokens: int | None = Field(default=None, ge=1)
    time_scale: float = Field(default=1.0, gt=0)
    start_s: float = Field(default=0.0, ge=0)
    duration_s: float | None = Field(default=None, gt=0)


class SloClassConfig(_Frozen):
    name: str
    ttft_ms: float = Field(gt=0)
    tpot_ms: float = Field(gt=0)
    weight: float = Field(default=1.0, gt=0)


class SloConfig(_Frozen):
    """TTFT targets: the BEAR paper's per-prompt formula, or a mix of SLO classes."""

    mode: Literal["bear", "classes"] = "bear"
    classes: tuple[SloClassConfig, ...] = (
        SloClassConfig(name="tight", ttft_ms=175.0, tpot_ms=39.7),
        SloClassConfig(name="loose", ttft_ms=525.0, tpot_ms=119.1),
    )


class PredictionConfig(_Frozen):
    """What the router is told of each request's output length and quality, per model of
    the pool (made once per workload, so every policy sees the same predictions):
    ``oracle``, the truth; ``noisy``, the truth times an independent uniform factor in
    [1 - ``noise``, 1 + ``noise``] per model, and quality plus an independent uniform
    error in [-``quality_noise``, +``quality_noise``] per model, clipped to [0, 1]
    (workloads with per-model quality: ``synthetic``); ``predictor``, a trained predictor
    (``olproute train-predictors``) saved in ``model_dir``, a path relative to the config
    file, predicting from the prompt text (``synthetic`` workloads). The default
    ``quality_noise`` is the size of a trained predictor's quality error: held out on the
    Qwen3 pool its MAE is 0.13, and +/-0.3 uniform, clipped to [0, 1], gives 0.12 (but
    independent per model, where the predictor's errors are correlated across models)."""

    mode: Literal["oracle", "noisy", "predictor"] = "noisy"
    noise: float = Field(default=0.2, ge=0, lt=1)
    quality_noise: float = Field(default=0.3, ge=0, le=1)
    model_dir: str | None = None


class SimConfig(_Frozen):
    """Simulator settings. ``timing: roofline`` is the ground truth; ``linear`` times
    batches with the 4-term model ``linear_beta`` (tests of the estimator only)."""

    seed: int = Field(default=0, ge=0)  # numpy's SeedSequence rejects negative seeds
    timing: Literal["roofline", "linear"] = "roofline"
    noise_cv: float = Field(default=0.03, ge=0, lt=1)
    batch_overhead_ms: float = Field(default=3.0, ge=0)
    linear_beta: tuple[float, float, float, float] = (3e-3, 5e-5, 1e-8, 1e-9)
    record_batches: bool = True
    # how old the instance snapshots are that snapshot-reading policies see (BEAR: 0-1000)
    snapshot_age_ms: float = Field(default=0.0, ge=0)


class TransferConfig(_Frozen):
    """Moving a request's KV cache from a prefill to a decode instance (disaggregated
    pools) takes ``latency_ms + KV bytes / (link_gbytes_per_s x 1e9)``, KV bytes from
    the model profile (prompt tokens x kv_bytes_per_token). The default link is
    100 Gb/s RDMA (12.5 GB/s) with 1 ms setup (NIXL-style transfer)."""

    link_gbytes_per_s: float = Field(default=12.5, gt=0)
    latency_ms: float = Field(default=1.0, ge=0)


class RouterConfig(_Frozen):
    policy: str = "round_robin"
    slot_ms: float = Field(default=50.0, gt=0)
    horizon_slots: int = Field(default=600, ge=1)
    policy_params: dict[str, dict[str, Any]] = Field(default_factory=dict)


class RewardConfig(_Frozen):
    """Weights of the multi-objective reward r_jg (DESIGN.md section 1) and of the TTFT
    penalty delta in the bid-price score. Latency terms count slots saved within the
    horizon, so not serving a request is never rewarded."""

    sigma: float = Field(default=1.0, ge=0)        # per request served (QPS)
    alpha: float = Field(default=0.0, ge=0)        # per token_norm tokens within the horizon
    token_norm: float = Field(default=1000.0, gt=0)
    beta: float = Field(default=0.01, ge=0)        # per slot of end-to-end latency saved
    gamma: float = Field(default=0.01, ge=0)       # per slot of TTFT saved
    zeta1: float = Field(default=0.0, ge=0)        # bonus if predicted EEL <= eel_threshold_s
    eel_threshold_s: float = Field(default=10.0, gt=0)
    zeta2: float = Field(default=0.0, ge=0)        # bonus if predicted TTFT <= its threshold
    ttft_threshold_s: float | None = Field(default=None, gt=0)  # None: the request's target
    omega: float = Field(default=0.0, ge=0)        # quality-cost utility acc - lambda*cost
    cost_lambda: float = Field(default=5e-4, ge=0)  # lambda; cost in micro-USD (BEAR eq. 4)
    delta: float = Field(default=1.0, ge=0)        # score penalty per second of TTFT estimate


class PriceConfig(_Frozen):
    """Online learning of the shadow prices (projected mini-batch SAA dual steps)."""

    enabled: bool = True   # false: prices stay 0 (free-capacity checks still run each period)
    period_slots: int = Field(default=10, ge=1)    # update every this many slots
    steps_per_period: int = Field(default=5, ge=1)  # K dual steps per update
    # eta0: price change per unit of (free capacity - demand), both in capacity fractions.
    # Prices must reach the reward scale (a request's reward over its usage, ~10 per slot)
    # within seconds; constant steps track a load that changes (inverse_sqrt settles).
    step_size: float = Field(default=2.0, gt=0)
    schedule: Literal["constant", "inverse_sqrt"] = "constant"
    window: int = Field(default=2000, ge=1)        # recent requests kept for sampling
    minibatch: int = Field(default=256, ge=1)      # samples per step (padded, fixed shape)
    arrival_rate_halflife_s: float = Field(default=10.0, gt=0)  # for N_H


class AdmissionConfig(_Frozen):
    """The central buffer: when a request is held, for how long, and what happens then.

    ``shed`` (the default) refuses a request whose patience runs out (HTTP 429 with
    Retry-After): a router that never refuses queues without bound under overload.
    ``defer`` sends it to the best instance anyway. At most ``max_held`` requests are held
    at once (a request the policy would hold past that is refused at once), and none is
    held longer than ``max_patience_s``, whatever its patience or TTFT target says."""

    mode: Literal["defer", "shed"] = "shed"
    patience_s: float | None = Field(default=None, ge=0)  # None: the request's TTFT target
    max_patience_s: float = Field(default=30.0, gt=0)     # caps patience_s and TTFT targets
    max_held: int = Field(default=256, ge=0)               # requests held at once
    candidates: int | None = Field(default=None, ge=1)   # sample d instances (None: all)
    # "can start now": the instance has a free batch slot, KV blocks for the prompt, and
    # at most this many requests already waiting
    max_waiting: int = Field(default=0, ge=0)


class BackendConfig(_Frozen):
    """A real serving backend: ``name`` must be one of the instances (its spec gives the
    limits the router models), ``url`` its OpenAI-compatible base URL."""

    name: str = Field(min_length=1)
    url: str = Field(pattern=r"^https?://")
    # optional: when given, it must be the role of the instance of that name
    role: Literal["mixed", "prefill", "decode"] | None = None


class ServerConfig(_Frozen):
    """``olproute serve``. With no ``backends``, every instance is emulated in-process
    (``olproute.emulator``): the embedded default."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    backends: tuple[BackendConfig, ...] = ()
    emulator_time_scale: float = Field(default=1.0, gt=0)  # emulated batch-time multiplier
    admin_token_env: str = "OLPROUTE_ADMIN_TOKEN"  # bearer token for /admin, from the env
    admin_token: str | None = None                 # or given here (the env wins)
    # folders (relative to this file) besides its own and configs/weights/ whose .yaml
    # profiles POST /admin/reload may name in its body
    reload_weights_dirs: tuple[str, ...] = ()
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    body_timeout_s: float = Field(default=5.0, gt=0)  # the whole body, else 408
    default_ttft_ms: float = Field(default=2000.0, gt=0)  # when x-slo-ttft-ms is absent
    default_max_tokens: int = Field(default=16, ge=1)
    request_timeout_s: float = Field(default=600.0, gt=0)  # a whole backend request
    connect_timeout_s: float = Field(default=2.0, gt=0)    # to open a backend connection
    # from sending a request to the first byte of its answer's body (a whole answer: the
    # answer; a stream: its first chunk), then between two chunks of a stream
    first_byte_timeout_s: float = Field(default=60.0, gt=0)
    read_timeout_s: float = Field(default=30.0, gt=0)
    # event-loop time per slot for re-scoring held requests: past it, the rest wait for
    # the next slot (round robin over the buffer), so the loop never starves
    hold_budget_ms: float = Field(default=10.0, gt=0)
    health_period_s: float = Field(default=2.0, gt=0)
    scrape_period_s: float = Field(default=1.0, gt=0)   # backends' /metrics
    recalibrate_period_s: float = Field(default=5.0, gt=0)
    retry_after_s: int = Field(default=1, ge=0)         # on 429


class Config(_Frozen):
    profiles: str = "profiles.yaml"
    instances: tuple[InstanceConfig, ...] = Field(min_length=1)
    workload: WorkloadConfig = WorkloadConfig()
    slo: SloConfig = SloConfig()
    prediction: PredictionConfig = PredictionConfig()
    sim: SimConfig = SimConfig()
    router: RouterConfig = RouterConfig()
    reward: RewardConfig = RewardConfig()
    prices: PriceConfig = PriceConfig()
    admission: AdmissionConfig = AdmissionConfig()
    transfer: TransferConfig = TransferConfig()
    # batch-time calibration for estimating policies: 'auto' profiles the scenario on
    # another seed first; otherwise a YAML file written by `olproute calibrate`
    calibration: str = "auto"
    server: ServerConfig = ServerConfig()


# -- loading -----------------------------------------------------------------------------
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
}


def _key_path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _problems(err: ValidationError, quote: bool = True) -> list[tuple[str, str]]:
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
    return _key_path(loc), msg


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


def _read_yaml(path: Path, quote: bool = True) -> Any:
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


def _validate(model: type[BaseModel], data: Any, path: Path, quote: bool = True) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(path, [("", "top level must be a mapping of keys")])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(path, _problems(exc, quote)) from exc


def workload_problems(wl: WorkloadConfig, prefix: str = "workload") -> list[tuple[str, str]]:
    """Checks across workload keys (which keys each kind needs)."""
    problems = []
    if wl.kind == "trace" and wl.path is None:
        problems.append((f"{prefix}.path", "required when kind is 'trace'"))
    if wl.kind in ("poisson", "mmpp2"):
        if wl.rate_per_s is None:
            problems.append((f"{prefix}.rate_per_s", f"required when kind is {wl.kind!r}"))
        if wl.num_requests is None and wl.duration_s is None:
            problems.append((f"{prefix}.num_requests", "give num_requests or duration_s"))
        fixed = wl.prompt_tokens is not None and wl.decode_tokens is not None
        if wl.lengths_path is None and not fixed:
            problems.append((f"{prefix}.lengths_path",
                             "give lengths_path or both prompt_tokens and decode_tokens"))
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
    data = _read_yaml(p)
    prefix = "workload"
    if isinstance(data, Mapping) and "workload" in data:
        data = data["workload"]
    if not isinstance(data, Mapping):
        raise ConfigError(p, [(prefix, "must be a mapping of keys")])
    try:
        workload = WorkloadConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(p, [(f"{prefix}.{k}" if k else prefix, m)
                              for k, m in _problems(exc)]) from exc
    problems = workload_problems(workload, prefix)
    if problems:
        raise ConfigError(p, problems)
    updates = {k: str((p.parent / v).resolve())
               for k in ("path", "lengths_path") if (v := getattr(workload, k))}
    return workload.model_copy(update=updates)


def load_profiles(path: str | os.PathLike[str], quote: bool = True) -> Profiles:
    p = Path(path)
    result: Profiles = _validate(Profiles, _read_yaml(p, quote), p, quote)
    return result


class LoadedConfig:
    """A validated config with its resolved profiles, instance specs and base folder;
    ``weights``: the weight profiles merged over it (``olproute.weights``), in order."""

    __slots__ = ("base_dir", "config", "path", "profiles", "specs", "weights")

    def __init__(self, path: Path, config: Config, profiles: Profiles,
                 weights: Sequence[Path] = ()) -> None:
        self.path = path
        self.base_dir = path.parent
        self.config = config
        self.profiles = profiles
        self.specs = instance_specs(config, profiles, path)
        self.weights = tuple(weights)

    def resolve(self, relative: str) -> Path:
        """A path from the config, relative to the config file's folder."""
        p = Path(relative)
        return p if p.is_absolute() else (self.base_dir / p)

    def with_updates(self, **sections: Any) -> LoadedConfig:
        """A copy with whole sections replaced (``workload=...``, ``router=...``)."""
        return LoadedConfig(self.path, self.config.model_copy(update=sections), self.profiles,
                            self.weights)


def kv_capacity_tokens(inst: InstanceConfig, model: ModelProfile, gpu: GpuProfile) -> int:
    """KV tokens that fit: (memory x utilisation - weights - activation reserve) per GPU,
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
                block_size=inst.block_size, num_kv_blocks=blocks, role=inst.role))
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


def load_config(path: str | os.PathLike[str] = DEFAULT_CONFIG,
                weights: Sequence[str | os.PathLike[str]] = (),
                quote: bool = True) -> LoadedConfig:
    """Read, validate and resolve a run configuration and the profiles it names; merge
    the ``weights`` profiles (``olproute.weights``) over its sections, in order.
    ``quote=False`` when a remote caller asks (``POST /admin/reload``): no error prints a
    line of a file (YAML syntax), a value a check refused or a key it made up; key paths
    and the checks' own messages remain."""
    p = Path(path)
    config: Config = _validate(Config, _read_yaml(p, quote), p, quote)
    if weights:
        from olproute.weights import apply_profiles

        config = apply_profiles(config, weights, quote)
    profiles_path = Path(config.profiles)
    if not profiles_path.is_absolute():
        profiles_path = p.parent / profiles_path
    if not profiles_path.exists():
        raise ConfigError(p, [("profiles", f"file not found: {profiles_path}")])
    problems = workload_problems(config.workload)
    problems += prediction_problems(config.prediction, config.workload.kind)
    from olproute.policies import REGISTRY  # registry needs the policy modules imported

    if config.router.policy not in REGISTRY.names():
        problems.append(("router.policy", f"unknown policy {config.router.policy!r} "
                         f"(known: {', '.join(REGISTRY.names())})"))
    for name in config.router.policy_params:
        if name not in REGISTRY.names():
            problems.append((f"router.policy_params.{name}", "unknown policy"))
    if problems:
        raise ConfigError(p, problems)
    loaded = LoadedConfig(p, config, load_profiles(profiles_path, quote),
                          tuple(Path(w).resolve() for w in weights))
    problems = backend_problems(config.server, loaded.specs)
    if problems:
        raise ConfigError(p, problems)
    return loaded


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
