"""Prometheus metrics of one emulated engine, under vLLM's names, in a registry of its own
(several instances share a process, so nothing goes to the global registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from olproute.types import InstanceSpec

# vLLM's buckets for time to first token and end-to-end latency, in seconds
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    """Counters and histograms updated by the engine; gauges set at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self._running = Gauge("vllm:num_requests_running",
                              "Number of requests in model execution batches.", labels,
                              registry=r).labels(model_name)
        self._waiting = Gauge("vllm:num_requests_waiting",
                              "Number of requests waiting to be processed.", labels,
                              registry=r).labels(model_name)
        self._kv = Gauge("vllm:kv_cache_usage_perc",
                         "KV-cache usage. 1 means 100 percent usage.", labels,
                         registry=r).labels(model_name)
        self._prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                               labels, registry=r).labels(model_name)
        self._generation = Counter("vllm:generation_tokens",
                                   "Number of generation tokens processed.", labels,
                                   registry=r).labels(model_name)
        self._preemptions = Counter("vllm:num_preemptions",
                                    "Cumulative number of preemptions from the engine.",
                                    labels, registry=r).labels(model_name)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=r)
        self._success = {reason: success.labels(model_name, reason)
                         for reason in ("stop", "length")}
        self._aborted = success.labels(model_name, "abort")
        # vLLM v1's prefix-cache counters (vllm/v1/metrics/loggers.py), in tokens; the
        # engine counts them, and ``render`` brings these up to its counts
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", labels,
            registry=r).labels(model_name)
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            labels, registry=r).labels(model_name)
        self._prefix_counted = (0, 0)
        self._ttft = Histogram("vllm:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.", labels,
                               buckets=TTFT_BUCKETS_S, registry=r).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of end to end request latency in seconds.", labels,
                              buckets=E2E_BUCKETS_S, registry=r).labels(model_name)

    def cache_config(self, spec: InstanceSpec, hash_algo: str = "sha256") -> None:
        """``vllm:cache_config_info`` (a gauge of 1), with the labels vLLM 0.32 gives it
        that mean something for an emulated engine (tests/data/kv_events has a real
        one's): its blocks, their count, prefix caching and its hash algorithm."""
        labels = {"block_size": str(spec.block_size), "cache_dtype": "auto",
                  "enable_prefix_caching": str(spec.enable_prefix_caching),
                  "engine": "0", "kv_cache_size_tokens": str(spec.kv_capacity_tokens),
                  "num_cpu_blocks": "None", "num_gpu_blocks": str(spec.num_kv_blocks),
                  "num_gpu_blocks_override": "None",
                  "prefix_caching_hash_algo": hash_algo,
                  "user_specified_block_size": "True"}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              list(labels), registry=self.registry).labels(**labels).set(1)

    def first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self._ttft.observe(ttft_s)
        self._prompt.inc(prompt_tokens)

    def generated(self, num_tokens: int) -> None:
        if num_tokens:
            self._generation.inc(num_tokens)

    def finished(self, e2e_s: float, preemptions: int, finish_reason: str = "length") -> None:
        """A request ended by its EOS (``finish_reason`` ``stop``) or at ``max_tokens``
        (``length``)."""
        self._e2e.observe(e2e_s)
        self._success[finish_reason].inc()
        if preemptions:
            self._preemptions.inc(preemptions)

    def aborted(self) -> None:
        self._aborted.inc()

    def render(self, num_running: int, num_waiting: int, kv_cache_usage: float,
               prefix_cache_queries: int = 0, prefix_cache_hits: int = 0) -> bytes:
        """The Prometheus text exposition, gauges set to the given state and the
        prefix-cache counters to the engine's counts (which only grow)."""
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv.set(kv_cache_usage)
        queries, hits = self._prefix_counted
        self._prefix_queries.inc(max(prefix_cache_queries - queries, 0))
        self._prefix_hits.inc(max(prefix_cache_hits - hits, 0))
        self._prefix_counted = (max(prefix_cache_queries, queries), max(prefix_cache_hits, hits))
        return generate_latest(self.registry)
