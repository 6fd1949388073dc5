"""The configuration's schema: frozen pydantic models, one per section, with bounds on
every key and its documentation in ``Field(description=...)``, the one place a key is
documented (weight profiles and ``olproute tune`` write these descriptions beside their
keys, ``key_docs``).

Reading and validating files is ``olproute.config.read``; ``olproute.config.loader`` loads a
whole run configuration (weight profiles merged, policy names and parameters checked).
Everything here is plain data, so that the policies may import it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def key_docs(model: type[BaseModel]) -> dict[str, str]:
    """Key -> its description, for the keys of a section that have one."""
    return {k: f.description for k, f in model.model_fields.items() if f.description}


# -- profiles -------------------------------------------------------------------------
class ModelProfile(_Frozen):
    """Architecture of one model, as in its config.json."""

    num_layers: int = Field(ge=1, description="transformer layers (config.json's "
                            "num_hidden_layers)")
    hidden_size: int = Field(ge=1, description="width of the hidden states, elements "
                             "(what a tensor-parallel all-reduce moves per token and layer)")
    num_attention_heads: int = Field(ge=1, description="query heads per layer (the "
                                     "attention FLOPs of the roofline)")
    num_kv_heads: int = Field(ge=1, description="key/value heads per layer "
                              "(num_key_value_heads; the KV cache's size)")
    head_dim: int = Field(ge=1, description="elements per attention head")
    num_params: float = Field(gt=0, description="parameters of the whole model (count, "
                              "e.g. 8.2e9): weight bytes and 2 FLOPs per parameter per token")
    bytes_per_param: float = Field(default=2.0, gt=0, description="bytes per weight "
                                   "(2: bf16), for the weights' memory and their reads")
    kv_bytes_per_element: float = Field(default=2.0, gt=0, description="bytes per KV "
                                        "cache element (2: bf16 / fp16)")
    max_context_tokens: int = Field(ge=1, description="the model's context window, "
                                    "tokens (prompt plus output; the emulator's "
                                    "max_model_len)")
    price_input_per_mtok: float = Field(
        default=0.0, ge=0, description="serving price of prompt tokens, USD per million "
        "tokens (0 when unknown: no cost term)")
    price_output_per_mtok: float = Field(
        default=0.0, ge=0, description="serving price of output tokens, USD per million "
        "tokens (0 when unknown: no cost term)")

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes one token occupies across all layers (K and V), whole model."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element


class GpuProfile(_Frozen):
    """One GPU: datasheet peaks plus the achievable fractions used by the roofline."""

    peak_bf16_flops: float = Field(gt=0, description="datasheet peak dense BF16 "
                                   "throughput of one GPU, FLOP/s")
    hbm_bandwidth_bytes_per_s: float = Field(gt=0, description="datasheet peak memory "
                                             "(HBM) bandwidth of one GPU, bytes/s")
    memory_gib: float = Field(gt=0, description="memory of one GPU, GiB")
    interconnect_bytes_per_s: float = Field(gt=0, description="GPU-to-GPU bandwidth of "
                                            "the tensor-parallel all-reduces, bytes/s")
    interconnect_latency_s: float = Field(ge=0, description="fixed latency of one "
                                          "tensor-parallel all-reduce, seconds")
    compute_efficiency: float = Field(gt=0, le=1, description="achievable fraction of "
                                      "peak_bf16_flops in the roofline")
    memory_efficiency: float = Field(gt=0, le=1, description="achievable fraction of "
                                     "hbm_bandwidth_bytes_per_s in the roofline")


class Profiles(_Frozen):
    models: dict[str, ModelProfile] = Field(description="model architectures by name "
                                            "(what instances[].model names)")
    gpus: dict[str, GpuProfile] = Field(description="GPUs by name (what "
                                        "instances[].gpu names)")


# -- the run configuration ---------------------------------------------------------------
class InstanceConfig(_Frozen):
    """One serving instance (or ``replicas`` identical ones), with vLLM's engine limits."""

    name: str = Field(min_length=1, description="the instance's name (with replicas > 1, "
                      "the replicas are NAME-0, NAME-1, ...)")
    model: str = Field(description="its model: a key of the profiles file's models")
    gpu: str = Field(description="its GPU: a key of the profiles file's gpus")
    tensor_parallel: int = Field(default=1, ge=1, le=16, description="GPUs per instance "
                                 "(tensor parallelism; weights and KV cache split "
                                 "across them)")
    replicas: int = Field(default=1, ge=1, description="identical instances this entry "
                          "stands for")
    max_num_seqs: int = Field(default=256, ge=1, description="most requests in one batch "
                              "(vLLM's --max-num-seqs)")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="most tokens "
                                        "scheduled in one batch (vLLM's "
                                        "--max-num-batched-tokens)")
    block_size: int = Field(default=16, ge=1, description="tokens per KV cache block "
                            "(vLLM's --block-size)")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="fraction "
                                          "of each GPU's memory the engine may use "
                                          "(vLLM's --gpu-memory-utilization)")
    activation_reserve_gib: float = Field(default=1.0, ge=0, description="memory per GPU "
                                          "kept for activations, GiB, not given to the KV "
                                          "cache")
    kv_capacity_tokens: int | None = Field(default=None, ge=1, description="KV cache "
                                           "size, tokens (e.g. from vLLM's \"GPU KV cache "
                                           "size\" log line); null: derived from the GPU's "
                                           "memory, the weights and activation_reserve_gib")
    role: Literal["mixed", "prefill", "decode"] = Field(
        default="mixed", description="mixed serves both phases; prefill / decode instances "
        "form disaggregated pools")
    enable_prefix_caching: bool = Field(
        default=True, description="vLLM's automatic prefix caching (on by default, as in "
        "vLLM v1): a request whose workload gives its prompt's block hashes starts after its "
        "longest cached prefix; requests without hashes are served as without caching")


class WorkloadConfig(_Frozen):
    """Arrivals and lengths.

    ``poisson`` / ``mmpp2`` generate arrivals at ``rate_per_s`` (MMPP-2 with rate ratio
    ``ratio``) and take lengths from ``lengths_path`` (a trace or lengths-only CSV,
    shuffled) or the fixed ``prompt_tokens`` / ``decode_tokens``. ``trace`` replays
    ``path`` with its own arrivals, stretched by ``time_scale`` or rescaled to
    ``rate_per_s`` when given. ``start_s`` / ``duration_s`` cut a window of a trace.
    ``synthetic`` generates prompts with text and per-model truth (``olproute.sim.prompts``)
    arriving at mean rate ``rate_per_s``, as a Poisson process or, with ``arrivals:
    mmpp2``, an MMPP-2 with rate ratio ``ratio`` (BEAR paper App. B). ``mooncake`` replays a
    Mooncake JSONL trace (``path``; ``data/mooncake``) as ``trace`` does, its requests
    carrying their prompts' block hashes (``olproute.sim.mooncake``) for blocks of
    ``block_tokens``, the instances' block size. ``synthetic`` with ``prefix_hashes``
    gives its requests their prompt texts' block hashes, blocks of ``block_tokens``
    words.
    """

    kind: Literal["poisson", "mmpp2", "trace", "synthetic", "mooncake"] = Field(
        default="trace", description="where the requests come from: generated arrivals "
        "(poisson, mmpp2) with trace or fixed lengths, a replayed CSV trace (trace), "
        "generated prompts with per-model truth (synthetic), a Mooncake JSONL trace "
        "(mooncake)")
    arrivals: Literal["poisson", "mmpp2"] = Field(
        default="poisson", description="arrival process of kind synthetic")
    rate_per_s: float | None = Field(default=None, gt=0, description="mean arrival rate, "
                                     "requests/s (required by poisson, mmpp2, synthetic); "
                                     "trace, mooncake: the trace's arrivals rescaled to it; "
                                     "null: as recorded, times time_scale")
    ratio: float = Field(default=3.0, ge=1, description="MMPP-2: arrival rate of the high "
                         "state over that of the low state (dimensionless)")
    num_requests: int | None = Field(default=None, ge=1, description="requests to "
                                     "generate (null: ceil(rate_per_s x duration_s)); "
                                     "trace, mooncake: at most the first this many of the "
                                     "window; null: all")
    path: str | None = Field(default=None, description="trace, mooncake: the trace file, "
                             "relative to the config file (trace: CSV of arrived_at, "
                             "num_prefill_tokens, num_decode_tokens; mooncake: JSONL)")
    lengths_path: str | None = Field(default=None, description="poisson, mmpp2: CSV of "
                                     "num_prefill_tokens, num_decode_tokens (relative to "
                                     "the config file) whose rows, shuffled, give the "
                                     "lengths; null: prompt_tokens and decode_tokens")
    prompt_tokens: int | None = Field(default=None, ge=1, description="poisson, mmpp2 "
                                      "without lengths_path: every prompt's length, "
                                      "tokens")
    decode_tokens: int | None = Field(default=None, ge=1, description="poisson, mmpp2 "
                                      "without lengths_path: every output's length, "
                                      "tokens")
    time_scale: float = Field(default=1.0, gt=0, description="trace, mooncake: factor "
                              "on the trace's arrival times (> 1 stretches it: lower "
                              "load); rate_per_s, when given, rescales after it")
    start_s: float = Field(default=0.0, ge=0, description="trace, mooncake: start of the "
                           "replayed window, seconds of (scaled) trace time")
    duration_s: float | None = Field(default=None, gt=0, description="length of the "
                                     "window from start_s, seconds; generated kinds: only "
                                     "arrivals before it are kept; null: no cut")
    block_tokens: int = Field(
        default=16, ge=1, description="kind mooncake: tokens per hashed block, the "
        "instances' block_size (a divisor of the trace's 512-token blocks); kind synthetic "
        "with prefix_hashes: words per hashed block, the instances' block_size")
    prefix_hashes: bool = Field(
        default=False, description="kind synthetic: each request carries its prompt text's "
        "block hashes (olproute.routing.prefix_index.text_block_hashes, blocks of block_tokens "
        "words, as the router and the emulator name a live prompt's blocks), so the "
        "engines' prefix caches and the router's prefix index see repeated prefixes; off, "
        "requests carry none, as before")


class SloClassConfig(_Frozen):
    name: str = Field(description="the class's name (a request's slo_class)")
    ttft_ms: float = Field(gt=0, description="time-to-first-token target, ms")
    tpot_ms: float = Field(gt=0, description="time-per-output-token target, ms")
    weight: float = Field(default=1.0, gt=0, description="relative share of requests "
                          "drawn into this class (probability proportional to weight)")


class SloConfig(_Frozen):
    """TTFT targets: the BEAR paper's per-prompt formula, or a mix of SLO classes."""

    mode: Literal["bear", "classes"] = Field(
        default="bear", description="bear: each request's TTFT target from the BEAR "
        "paper's per-prompt formula; classes: each request drawn into one of classes")
    classes: tuple[SloClassConfig, ...] = Field(default=(
        SloClassConfig(name="tight", ttft_ms=175.0, tpot_ms=39.7),
        SloClassConfig(name="loose", ttft_ms=525.0, tpot_ms=119.1),
    ), description="mode classes: the SLO classes, each with its TTFT and TPOT targets")


class PredictionConfig(_Frozen):
    """What the router is told of each request's output length and quality, per model of
    the pool.

    In the simulator (``mode``; made once per workload, so every policy sees the same
    predictions): ``oracle``, the truth; ``noisy``, the truth times an independent uniform
    factor in [1 - ``noise``, 1 + ``noise``] per model, and quality plus an independent
    uniform error in [-``quality_noise``, +``quality_noise``] per model, clipped to [0, 1]
    (workloads with per-model quality: ``synthetic``); ``predictor``, a trained predictor
    (``olproute train-predictors``) saved in ``model_dir``, a path relative to the config
    file, predicting from the prompt text (``synthetic`` workloads). The default
    ``quality_noise`` is the size of a trained predictor's quality error: held out on the
    Qwen3 pool its MAE is 0.13, and +/-0.3 uniform, clipped to [0, 1], gives 0.12 (but
    independent per model, where the predictor's errors are correlated across models).

    Served (``olproute serve``; ``serve``): the server has no truth, so ``oracle`` and
    ``noisy`` cannot apply there, and ``mode`` is not read. ``serve: predictor`` (the
    default) runs a trained predictor on each request's prompt text when it arrives: the
    one saved in ``model_dir`` when that is given (the folder ``mode: predictor`` reads),
    else the package's shipped one (``olproute/predict/shipped``, trained on synthetic
    prompts of every model with synthetic truth). It is loaded and warmed at start-up (a
    folder that does not load stops it, naming ``prediction.model_dir``), and gives each
    request its predicted output length (rounded, at least 1, at most the request's
    ``max_tokens``) and quality on every model of the pool, the fields ``mode: predictor``
    gives a simulated request. A request without prompt text (token ids, or ``/route``
    with ``prompt_tokens`` alone) is predicted ``max_tokens``, and so is every request
    on a model the predictor was not trained for (said once at start-up, and in
    ``/instances``); ``/route``'s ``predicted_tokens`` overrides the length. ``serve:
    max_tokens``: no predictor; every request is predicted its ``max_tokens``, the most
    the backend will generate."""

    mode: Literal["oracle", "noisy", "predictor"] = Field(
        default="noisy", description="the simulator's predictions: the truth (oracle), "
        "the truth with noise (noisy) or model_dir's trained predictor (predictor); "
        "olproute serve does not read it")
    noise: float = Field(default=0.2, ge=0, lt=1, description="noisy: predicted length = "
                         "true length x a uniform factor in [1 - noise, 1 + noise], per "
                         "model (a fraction)")
    quality_noise: float = Field(default=0.3, ge=0, le=1, description="noisy: predicted "
                                 "quality = true quality + a uniform error in "
                                 "[-quality_noise, +quality_noise], clipped to [0, 1]")
    model_dir: str | None = Field(default=None, description="folder of a trained "
                                  "predictor (olproute train-predictors), relative to the "
                                  "config file: required by mode predictor; olproute "
                                  "serve runs it, else the shipped one (serve: predictor)")
    serve: Literal["predictor", "max_tokens"] = Field(
        default="predictor", description="olproute serve: 'predictor' predicts each "
        "request's output length and quality from its prompt text (model_dir's predictor, "
        "else the shipped one); 'max_tokens' predicts every request its max_tokens")


class SimConfig(_Frozen):
    """Simulator settings. ``timing: roofline`` is the ground truth; ``linear`` times
    batches with the 4-term model ``linear_beta`` (tests of the estimator only)."""

    seed: int = Field(default=0, ge=0, description="the run seed (numpy's SeedSequence "
                      "rejects negative seeds)")
    timing: Literal["roofline", "linear"] = Field(
        default="roofline", description="batch times: the roofline of the model and GPU "
        "profiles (the ground truth), or the 4-term model linear_beta (estimator tests)")
    noise_cv: float = Field(default=0.03, ge=0, lt=1, description="coefficient of "
                            "variation of the lognormal noise (mean 1) multiplying each "
                            "simulated or emulated batch time (0: none)")
    batch_overhead_ms: float = Field(default=3.0, ge=0, description="fixed time added to "
                                     "each roofline batch, ms")
    linear_beta: tuple[float, float, float, float] = Field(
        default=(3e-3, 5e-5, 1e-8, 1e-9), description="timing linear: batch seconds = b0 "
        "+ b1 x num_tokens + b2 x sum_decode_context + b3 x sum_prefill_attention")
    record_batches: bool = Field(default=True, description="keep every simulated batch "
                                 "in the run's batch log (what calibration and "
                                 "--batch-log read); false: no log")
    snapshot_age_ms: float = Field(
        default=0.0, ge=0, description="how old the instance snapshots are that "
        "snapshot-reading policies see (BEAR: 0-1000)")
    snapshot_view: Literal["engine", "router"] = Field(
        default="engine", description="what snapshot-reading policies see of an engine: "
        "its exact scheduler state, or what a router rebuilds of it from its own traffic "
        "(olproute.routing.tracked: no batch in flight, no prefill progress, preempted requests "
        "still running), as olproute serve sees real backends")
    prefix_index: Literal["approximate", "exact"] = Field(
        default="approximate", description="what the simulated routers' prefix index "
        "knows of the engines' prefix caches: the block hashes each router sent where, "
        "aged by routing order (approximate), or what each engine says it holds, from "
        "its KV events after every batch, as vLLM publishes them (exact)")


class TransferConfig(_Frozen):
    """Moving a request's KV cache from a prefill to a decode instance (disaggregated
    pools) takes ``latency_ms + KV bytes / (link_gbytes_per_s x 1e9)``, KV bytes from
    the model profile (prompt tokens x kv_bytes_per_token). The default link is
    100 Gb/s RDMA (12.5 GB/s) with 1 ms setup (NIXL-style transfer)."""

    link_gbytes_per_s: float = Field(default=12.5, gt=0, description="bandwidth of the "
                                     "prefill-to-decode link, GB/s (1e9 bytes/s)")
    latency_ms: float = Field(default=1.0, ge=0, description="fixed setup time of each KV "
                              "transfer, ms")


class RouterConfig(_Frozen):
    policy: str = Field(default="round_robin", description="the routing policy, by its "
                        "registered name")
    slot_ms: float = Field(default=50.0, gt=0, description="length of a time slot, ms: "
                           "the unit of the price horizon and of the reward's latency "
                           "terms; held requests are re-scored once a slot")
    horizon_slots: int = Field(default=600, ge=1, description="slots in the horizon the "
                               "shadow prices cover (horizon = horizon_slots x slot_ms)")
    policy_params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per policy name, that policy's parameters "
        "(each policy's typed parameter model, checked when the config is loaded)")


class RewardConfig(_Frozen):
    """Weights of the multi-objective reward r_jg (docs/design.md section 1) and of the TTFT
    penalty delta in the bid-price score. Latency terms count slots saved within the
    horizon, so not serving a request is never rewarded."""

    sigma: float = Field(default=1.0, ge=0,
                         description="reward per request served (QPS term)")
    alpha: float = Field(default=0.0, ge=0, description="reward per token_norm tokens "
                         "(prompt + predicted output) in the horizon")
    token_norm: float = Field(default=1000.0, gt=0,
                              description="tokens per unit of the throughput term")
    beta: float = Field(default=0.01, ge=0, description="reward per slot of end-to-end "
                        "latency saved within the horizon")
    gamma: float = Field(default=0.01, ge=0,
                         description="reward per slot of TTFT saved within the horizon")
    zeta1: float = Field(default=0.0, ge=0, description="bonus when the predicted "
                         "end-to-end latency <= eel_threshold_s")
    eel_threshold_s: float = Field(default=10.0, gt=0, description="end-to-end latency "
                                   "threshold of zeta1, seconds")
    zeta2: float = Field(default=0.0, ge=0, description="bonus when the predicted TTFT <= "
                         "ttft_threshold_s (tail TTFT)")
    ttft_threshold_s: float | None = Field(default=None, gt=0, description="TTFT threshold "
                                           "of zeta2, seconds; null: each request's target")
    omega: float = Field(default=0.0, ge=0, description="weight of the quality-cost utility "
                         "(quality - cost_lambda * cost)")
    cost_lambda: float = Field(default=5e-4, ge=0, description="lambda: utility lost per "
                               "micro-USD of serving cost")
    delta: float = Field(default=1.0, ge=0, description="score penalty per second of "
                         "estimated TTFT (not part of the reward)")


class PriceConfig(_Frozen):
    """Online learning of the shadow prices (projected mini-batch SAA dual steps, see
    ``olproute.pricing.step_ref``).

    With ``schedule: adagrad`` (the default) ``step_size`` is a dimensionless fraction of
    the window's break-even price (a request's reward over the capacity it uses), so one
    value fits every scenario; with ``constant`` or ``inverse_sqrt`` it is eta0 in price
    units per capacity fraction of (free capacity - demand)."""

    enabled: bool = Field(default=True, description="learn shadow prices at all (false: "
                          "prices stay 0)")
    period_slots: int = Field(default=10, ge=1,
                              description="update the prices every this many slots")
    steps_per_period: int = Field(default=5, ge=1, description="K: dual steps per update")
    step_size: float = Field(default=0.5, gt=0, description="adagrad: fraction of the "
                             "break-even price per step; constant / inverse_sqrt: eta0, the "
                             "price change per unit of (free capacity - demand)")
    schedule: Literal["constant", "inverse_sqrt", "adagrad"] = Field(
        default="adagrad", description="step sizes: adagrad (per-coordinate, scaled to the "
        "break-even price), constant, or inverse_sqrt (eta0 / sqrt(t + 1))")
    average_halflife_updates: float = Field(
        default=6.0, ge=0, allow_inf_nan=False, description="the prices decisions read are "
        "a moving average of the steps' prices with this half-life in updates (0: the last "
        "step's): a stochastic step's noise, averaged out")
    adagrad_halflife_steps: float = Field(default=500.0, gt=0, description="adagrad: "
                                          "half-life of the squared-gradient sum, steps")
    sample_delays_slots: tuple[int, ...] = Field(
        default=(0, 4, 16, 64), min_length=1, description="delays (slots) each demand sample "
        "may start after, as the LP may delay a start; the first must be 0")
    window: int = Field(default=2000, ge=1, description="recent requests kept for sampling")
    minibatch: int = Field(default=256, ge=1, description="samples per dual step")
    arrival_rate_halflife_s: float = Field(default=10.0, gt=0, description="half-life of "
                                           "the arrival-rate estimate behind N_H, s")
    decode_load_halflife_s: float | None = Field(
        default=5.0, gt=0, allow_inf_nan=False, description="half-life of each instance's "
        "dispatch rate and lengths behind its steady decode step, s: a request is held for "
        "its predicted output times the steady step (the decode step of now until the "
        "instance has a rate; olproute.estimate.decode_load); null: the step of now")
    resolve_period_s: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="bid_price: every this many "
        "seconds, solve the exact LP of the last resolve_window_s of demand moved to "
        "now on the free capacity of now, off the request path, and take its duals as the "
        "prices (the steps refine them in between); the first as soon as one window "
        "exists; a failed or slow solve keeps the last prices. null: never")
    resolve_window_s: float = Field(
        default=5.0, gt=0, allow_inf_nan=False, description="the re-solved window: the "
        "requests that arrived in the last this many seconds and were decided")
    resolve_time_limit_s: float = Field(
        default=5.0, gt=0, allow_inf_nan=False, description="time limit of one re-solve "
        "(HiGHS), seconds; a solve that hits it keeps the last prices")
    certify_period_s: float | None = Field(
        default=60.0, gt=0, allow_inf_nan=False, description="olproute serve, bid_price: "
        "every this many seconds, check the prices of the last window against the exact LP "
        "in a background process (D(p_online)/LP* - 1 on /metrics, /prices and "
        "/dashboard); null: never")
    certify_window_s: float = Field(
        default=60.0, gt=0, allow_inf_nan=False, description="the checked window: requests "
        "that arrived at most this many seconds before its end (the first request still "
        "running, or now)")
    certify_max_requests: int = Field(
        default=2000, ge=1, description="at most this many requests in a checked window "
        "(the most recent; the router keeps this many)")
    certify_time_limit_s: float = Field(
        default=30.0, gt=0, allow_inf_nan=False, description="time limit of one check's "
        "LP solve (HiGHS), seconds; a check that hits it reports the LP's best bound")
    certify_gap_tol: float = Field(
        default=0.0, ge=0, allow_inf_nan=False, description="a check's column generation "
        "may stop when D(p) - LP master <= this fraction of the master (0: exact; the "
        "certificate is then at most this much too high, never too low)")

    @field_validator("sample_delays_slots")
    @classmethod
    def _delays(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if v[0] != 0 or any(d < 0 for d in v) or list(v) != sorted(set(v)):
            raise ValueError("must start at 0 and increase")
        return v


class AdmissionConfig(_Frozen):
    """The central buffer: when a request is held, for how long, and what happens then.

    ``shed`` (the default) sends a request whose patience runs out to the best instance
    whose engine has room for it (a batch slot and KV blocks left after its queue) and
    refuses it (HTTP 429 with Retry-After, code
    ``no_room``) only when there is none: a router that never refuses queues without
    bound under overload, one that refuses what its engines can take loses traffic.
    ``defer`` sends it to the best instance anyway. At most ``max_held`` requests are held
    at once (a request the policy would hold past that is refused at once), and none is
    held longer than ``max_patience_s``, whatever its patience or TTFT target says."""

    mode: Literal["defer", "shed"] = Field(
        default="shed", description="when patience runs out: defer (send to the best "
        "instance) or shed (429)")
    patience_s: float | None = Field(default=None, ge=0, description="how long a request "
                                     "may wait in the router, seconds; null: its target")
    max_patience_s: float = Field(default=30.0, gt=0, description="caps patience_s and "
                                  "TTFT targets, seconds")
    max_held: int = Field(default=256, ge=0, description="requests held at once")
    candidates: int | None = Field(default=None, ge=1, description="instances sampled per "
                                   "decision (against herding); null: all")
    max_waiting: int = Field(default=0, ge=0, description="an instance can start a request "
                             "if at most this many already wait")


class KvEventsConfig(_Frozen):
    """A backend's KV-cache events (vLLM's ``--kv-events-config`` with the zmq publisher):
    the router subscribes and its prefix index for that backend is exact
    (``olproute.server.kv_subscriber``). It names prompts' blocks as the engine does, so it
    needs the engine's tokenizer and hash setting."""

    endpoint: str = Field(pattern=r"^(tcp|ipc)://", description="the engine's PUB socket "
                          "to connect to, e.g. tcp://10.0.0.5:5557 (vLLM's endpoint "
                          "tcp://*:5557 seen from the router)")
    replay_endpoint: str | None = Field(
        default=None, pattern=r"^(tcp|ipc)://", description="its replay (ROUTER) socket, "
        "to fill gaps in the stream; none: a gap empties that backend's index")
    topic: str = Field(default="", description="the topic it publishes on (vLLM's topic; "
                       "default empty, as vLLM's)")
    tokenizer: str = Field(min_length=1, description="the engine's tokenizer: a local "
                           "folder with tokenizer.json (relative to this file; never "
                           "downloaded), or 'words' for olproute's emulator")
    hash_algo: Literal["sha256", "sha256_cbor"] = Field(
        default="sha256", description="the engine's --prefix-caching-hash-algo (xxhash "
        "seeds itself at random per engine and cannot be matched)")
    hash_seed: str | None = Field(default=None, description="the engine's PYTHONHASHSEED "
                                  "if it sets one (it seeds vLLM's block hashes)")
    replay_timeout_s: float = Field(default=2.0, gt=0, description="how long a replay may "
                                    "take before the gap counts as lost")


class BackendConfig(_Frozen):
    """A real serving backend: ``name`` must be one of the instances (its spec gives the
    limits the router models), ``url`` its OpenAI-compatible base URL, ``served_model``
    the model name it answers to (vLLM's ``--served-model-name``; by default the
    instance's profile name, e.g. ``qwen3-0.6b``)."""

    name: str = Field(min_length=1, description="the instance this backend serves, by "
                      "its name after replicas (NAME, or NAME-0, NAME-1, ...)")
    url: str = Field(pattern=r"^https?://", description="the backend's OpenAI-compatible "
                     "base URL")
    served_model: str | None = Field(
        default=None, min_length=1, description="the model name sent to this backend in "
        "every request (vLLM's --served-model-name, e.g. Qwen/Qwen3-0.6B); default the "
        "instance's profile model name")
    role: Literal["mixed", "prefill", "decode"] | None = Field(
        default=None, description="optional: when given, it must be the role of the "
        "instance of that name")
    kv_events: KvEventsConfig | None = Field(
        default=None, description="its engine's KV-cache events, for an exact prefix index "
        "of what it caches; none: the router's approximate index of what it sent there")


class ServerConfig(_Frozen):
    """``olproute serve``. With no ``backends``, every instance is emulated in-process
    (``olproute.emulator``): the embedded default."""

    host: str = Field(default="127.0.0.1", description="address olproute serve listens "
                      "on (--host overrides it)")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port olproute serve "
                      "listens on (--port overrides it)")
    backends: tuple[BackendConfig, ...] = Field(
        default=(), description="the real backends, one per instance; none: every "
        "instance emulated in-process")
    emulator_time_scale: float = Field(default=1.0, gt=0,
                                       description="emulated batch-time multiplier")
    emulator_exact_lengths: bool = Field(
        default=False, description="emulated requests generate exactly max_tokens, instead "
        "of stopping where their prompt's model would (olproute.emulator.lengths)")
    emulator_stream_interval: int = Field(
        default=1, ge=1, description="emulated streams send their first token at once, then "
        "every N tokens (vLLM's --stream-interval)")
    emulator_kv_events: bool = Field(
        default=False, description="emulated instances publish their KV-cache events as "
        "vLLM does (olproute.emulator.kv_publisher, on free ports of 127.0.0.1) and the "
        "router subscribes: its prefix index of each is exact (tokenizer words, sha256)")
    emulator_truth: str | None = Field(
        default=None, description="CSV or JSONL of prompt, model, output_tokens (relative "
        "to this file): where emulated requests with these prompts stop")
    admin_token_env: str = Field(default="OLPROUTE_ADMIN_TOKEN",
                                 description="bearer token for /admin, from the env")
    admin_token: str | None = Field(default=None, description="or given here (the env wins)")
    reload_weights_dirs: tuple[str, ...] = Field(
        default=(), description="folders (relative to this file) besides its own and "
        "configs/weights/ whose .yaml profiles POST /admin/reload may name in its body")
    max_body_bytes: int = Field(default=1_048_576, ge=1024, description="largest request "
                                "body, bytes; a larger one is refused with 413")
    body_timeout_s: float = Field(default=5.0, gt=0, description="the whole body, else 408")
    default_ttft_ms: float = Field(default=2000.0, gt=0,
                                   description="when x-slo-ttft-ms is absent")
    default_max_tokens: int = Field(default=16, ge=1, description="output-token limit, "
                                    "tokens, of a request that gives none (max_tokens or "
                                    "max_completion_tokens); a proxied one is sent with it")
    request_timeout_s: float = Field(default=600.0, gt=0,
                                     description="a whole backend request")
    connect_timeout_s: float = Field(default=2.0, gt=0,
                                     description="to open a backend connection")
    first_byte_timeout_s: float = Field(
        default=60.0, gt=0, description="from sending a request to its answer's headers "
        "(a whole answer comes with them), and again from the headers of a stream to its "
        "first chunk")
    read_timeout_s: float = Field(default=30.0, gt=0,
                                  description="between two chunks of a stream")
    hold_budget_ms: float = Field(
        default=10.0, gt=0, description="event-loop time per slot for re-scoring held "
        "requests: past it, the rest wait for the next slot (round robin over the buffer), "
        "so the loop never starves")
    health_period_s: float = Field(default=2.0, gt=0, description="seconds between two "
                                   "probes of a healthy backend's /health (a failed one "
                                   "waits its backoff, health_max_backoff_s)")
    health_max_backoff_s: float = Field(
        default=30.0, gt=0, description="a failed backend is probed again after 0.5 s, "
        "then after twice as long at each failure, up to this")
    health_timeout_s: float = Field(
        default=1.0, gt=0, description="a backend's /health must answer within this, or "
        "the probe fails (the backend is taken out and probed again after a backoff)")
    scrape_period_s: float = Field(default=1.0, gt=0, description="backends' /metrics")
    prefill_from_kv_events: bool = Field(
        default=False, description="a request whose prompt blocks its engine's KV events "
        "say it stored is taken to be running, in prefill with those tokens computed, in "
        "the snapshots BEA replays (backends with kv_events only); false: running only "
        "once its first token streams")
    running_from_scrape: bool = Field(
        default=False, description="the engine's scraped vllm:num_requests_running marks "
        "that many of the earliest dispatched requests running (in prefill when they "
        "have no token yet) in the snapshots BEA replays, as of the scrape")
    recalibrate_period_s: float = Field(default=5.0, gt=0, description="seconds between "
                                        "two feeds of each backend's new batch records (or "
                                        "stream events) to its batch-time calibration, "
                                        "which refits beta when due")
    retry_after_s: int = Field(default=1, ge=0, description="on 429")
    any_model: bool = Field(
        default=False, description="a completion whose model no backend serves (by its "
        "profile's model name or its served_model) goes to the whole pool, the name an "
        "alias; false: it is a 404 (code model_not_found), as OpenAI and vLLM answer")


STATE_URL = r"^(redis|rediss|unix)://"


class StateConfig(_Frozen):
    """Router replicas' shared state (``olproute serve --state``; ``olproute.server.
    shared``). Without ``url`` each router keeps its own (in-process, the default). With
    one, every replica publishes its ledger of each backend's requests every ``sync_ms``
    and merges the others'; one holds the leader lease, learns the prices and runs the
    LP certificate; the others read its prices."""

    url: str | None = Field(default=None, pattern=STATE_URL, description="redis://HOST:"
                            "PORT/DB (or rediss://, unix://): the replicas' shared state; "
                            "none: in-process")
    sync_ms: float = Field(default=50.0, gt=0, description="a replica publishes its ledger "
                           "and reads the others' this often")
    lease_ms: float = Field(default=1000.0, gt=0, description="the leader lease: a dead "
                            "leader is replaced within two of these")
    timeout_ms: float = Field(default=250.0, gt=0, description="each exchange with Redis; "
                              "past it the replica goes on with its local state")
    namespace: str = Field(default="olproute", min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$",
                           description="prefix of the keys: the routers of one fleet share "
                           "it")
    replica: str | None = Field(default=None, min_length=1, description="this replica's "
                                "name (default: host:pid and a random suffix)")
    secret_file: str | None = Field(default=None, min_length=1, description="a file "
                                    "holding the secret every replica of the fleet shares "
                                    "(relative to the config file; olproute serve "
                                    "--state-secret-file): what a replica writes to Redis "
                                    "is signed with it and what it reads checked; none: "
                                    "the environment variable OLPROUTE_STATE_SECRET")
    insecure: bool = Field(default=False, description="run without a secret (olproute "
                           "serve --state-insecure): the replicas' messages are not "
                           "signed, and anything that can write to the Redis can steer "
                           "the routers; false: a replica without a secret refuses to "
                           "start")

    @model_validator(mode="after")
    def _lease_longer_than_sync(self) -> StateConfig:
        if self.lease_ms < 2 * self.sync_ms:
            raise ValueError(f"lease_ms ({self.lease_ms:g}) must be at least twice sync_ms "
                             f"({self.sync_ms:g}): the leader renews its lease at each sync")
        return self


class Config(_Frozen):
    profiles: str = Field(default="profiles.yaml", description="the profiles file (models, "
                          "GPUs), relative to the config file")
    instances: tuple[InstanceConfig, ...] = Field(min_length=1, description="the serving "
                                                  "instances")
    workload: WorkloadConfig = WorkloadConfig()
    slo: SloConfig = SloConfig()
    prediction: PredictionConfig = PredictionConfig()
    sim: SimConfig = SimConfig()
    router: RouterConfig = RouterConfig()
    reward: RewardConfig = RewardConfig()
    prices: PriceConfig = PriceConfig()
    admission: AdmissionConfig = AdmissionConfig()
    transfer: TransferConfig = TransferConfig()
    calibration: str = Field(
        default="auto", description="batch-time calibration for estimating policies: "
        "'auto' profiles the scenario on another seed first; otherwise a YAML file "
        "written by `olproute calibrate`")
    server: ServerConfig = ServerConfig()
    state: StateConfig = StateConfig()
