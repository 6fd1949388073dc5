"""Prometheus metrics of one router, in a registry of its own (several routers, or a
router and its emulated backends, can live in one process)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from olproute.pricing.reward import RESOURCES
from olproute.server.shared import SharedStatus

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
HANDOFF_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
LOOP_LAG_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2,
                      0.5, 1.0, 2.0, 5.0)
DECISION_BUCKETS_S = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3,
                      12.8e-3, 25.6e-3)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("olproute_decisions", "Routing decisions by action and "
                                 "instance", ["action", "instance"], registry=r)
        self.decision_seconds = Histogram("olproute_decision_seconds", "Time to decide one "
                                          "request", buckets=DECISION_BUCKETS_S, registry=r)
        self.ttft_seconds = Histogram("olproute_ttft_seconds", "Observed time to first token, "
                                      "from arrival at the router, by the instance that gave "
                                      "it (on disaggregated pools the decode instance)",
                                      ["instance"],
                                      buckets=LATENCY_BUCKETS_S, registry=r)
        self.eel_seconds = Histogram("olproute_eel_seconds", "Observed end-to-end latency "
                                     "of finished requests", ["instance"],
                                     buckets=LATENCY_BUCKETS_S, registry=r)
        self.handoff_seconds = Histogram(
            "olproute_handoff_seconds", "Disaggregated pools: from the end of a request's "
            "prefill to its streamed decode's first token (KV transfer, queueing and first "
            "decode step), by decode instance", ["instance"],
            buckets=HANDOFF_BUCKETS_S, registry=r)
        self.in_flight = Gauge("olproute_requests_in_flight", "Requests dispatched and not "
                               "finished", ["instance"], registry=r)
        self.backend_up = Gauge("olproute_backend_up", "1 if the backend passes its health "
                                "checks", ["instance"], registry=r)
        self.backend_scraped = Gauge(
            "olproute_backend_scraped", "A backend's own gauge as last scraped from its "
            "/metrics (gauge: vllm:num_requests_running, vllm:num_requests_waiting, "
            "vllm:kv_cache_usage_perc; summed over its label sets)", ["instance", "gauge"],
            registry=r)
        self._add_prefix_index(r)
        self._add_engine_config(r)
        self.price_sum = Gauge("olproute_price_sum", "Sum over the horizon of the shadow "
                               "price (resource: batch, kv or compute)",
                               ["instance", "resource"], registry=r)
        self.price_updates = Counter("olproute_price_updates", "Shadow-price updates",
                                     registry=r)
        self.errors = Counter("olproute_backend_errors", "Backend failures by kind",
                              ["instance", "kind"], registry=r)
        self.shared_up = Gauge("olproute_shared_state_up", "1 while this replica shares "
                               "state with the others on Redis (--state), 0 while it goes "
                               "on alone", registry=r)
        self.shared_leader = Gauge("olproute_shared_leader", "1 while this replica holds "
                                   "the leader lease (learns and publishes the prices)",
                                   registry=r)
        self.shared_replicas = Gauge("olproute_shared_replicas", "Router replicas seen at "
                                     "the last sync, this one included", registry=r)
        self.shared_failures = Gauge("olproute_shared_sync_failures", "Syncs with Redis "
                                     "that failed since start", registry=r)
        self._add_shared_rejected(r)
        self._add_admission(r)
        self.loop_lag_seconds = Histogram(
            "olproute_loop_lag_seconds", "How late the event loop ran a timer (sampled every "
            "10 ms)", buckets=LOOP_LAG_BUCKETS_S, registry=r)
        self._add_live_jobs(r)
        self.calibration_rows = Gauge(
            "olproute_calibration_rows", "Rows in a backend's window for recalibration from "
            "its streams, by kind (prefill, decode; olproute.estimate.streamcal)",
            ["instance", "kind"], registry=r)
        self.beta_refits = Counter("olproute_beta_refits", "Refits of a backend's batch-time "
                                   "coefficients, by source (batches: its batch records; "
                                   "streams: the streams relayed from it)",
                                   ["instance", "source"], registry=r)
        self.probes = Counter("olproute_health_probes", "Health probes by result (ok, "
                              "failed, inconclusive: timed out while the router's own "
                              "event loop lagged)", ["instance", "result"], registry=r)

        # labelled children of the request path's metrics, by (metric, labels): a
        # child's lookup through .labels() takes a lock and builds its key every time
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}

    def _add_admission(self, r: CollectorRegistry) -> None:
        """The central buffer's metrics and the router's own refusals."""
        self.held = Gauge("olproute_held_requests", "Requests waiting in the router's "
                          "central buffer", registry=r)
        self.held_dropped = Counter("olproute_held_dropped", "Held requests dropped because "
                                    "their client left", registry=r)
        self.held_full = Counter("olproute_held_full", "Requests refused because the central "
                                 "buffer was full (admission.max_held)", registry=r)
        self.refused = Counter(
            "olproute_refused", "Requests the router refused itself, by reason: no_room (no "
            "engine could start it once its patience ran out: 429), late (every engine "
            "with room would queue it past another TTFT target: 429), patience (out of "
            "patience where the policy knows no room: 429), buffer_full (429), no_backend "
            "(none healthy: 429), price (the primal form: 429), context (longer than any "
            "instance's context or KV: 400)", ["reason"], registry=r)

    def _add_prefix_index(self, r: CollectorRegistry) -> None:
        """The prefix index's and the KV-event streams' metrics."""
        self.prefix_index_blocks = Gauge(
            "olproute_prefix_index_blocks", "Prompt blocks the router's prefix index holds "
            "for the backend (olproute.routing.prefix_index)", ["instance"], registry=r)
        self.prefix_index_exact = Gauge(
            "olproute_prefix_index_exact", "1 if the backend's prefix index is exact (fed by "
            "its engine's KV events: olproute.server.kv_subscriber), 0 if approximate (what "
            "the router sent there)", ["instance"], registry=r)
        self.kv_events_age = Gauge(
            "olproute_kv_events_age_seconds", "Seconds since the last KV-event batch from "
            "the backend's engine was applied (absent before the first)", ["instance"],
            registry=r)
        self.kv_events = Gauge(
            "olproute_kv_events", "KV-event stream of the backend so far (what: batches, "
            "gaps_replayed, gaps_lost, restarts)", ["instance", "what"], registry=r)

    def _add_shared_rejected(self, r: CollectorRegistry) -> None:
        self.shared_rejected = Counter(
            "olproute_shared_state_rejected", "What this replica read from Redis and dropped "
            "(olproute.server.shared_parse, shared_auth), by kind (ledger, demand, prices, "
            "lease) and reason",
            ["kind", "reason"], registry=r)
        self._rejected_seen: dict[tuple[str, str], int] = {}   # counted so far, by labels

    def _add_engine_config(self, r: CollectorRegistry) -> None:
        self.engine_mismatch = Gauge(
            "olproute_engine_config_mismatch", "1 while the backend's engine says it runs "
            "with another block size, KV-block count, prefix caching or hash setting than "
            "its profile (vllm:cache_config_info; /instances engine_config names which)",
            ["instance"], registry=r)

    def _add_live_jobs(self, r: CollectorRegistry) -> None:
        """The live certificate's and the re-solves' metrics."""
        self.certificate_checks = Counter(
            "olproute_price_certificate_checks", "Live certificate checks by result (ok, "
            "error, empty: nothing to check, skipped: the last was still running)",
            ["result"], registry=r)
        self.price_resolves = Counter(
            "olproute_price_resolves", "Re-solves of the prices (prices.resolve_period_s) by "
            "outcome (ok: the LP's duals were handed to the price book, slow: the solve hit "
            "its time limit, failed: the solver failed, empty: nothing to solve, error: the "
            "re-solve raised, skipped: the last was still running)", ["outcome"], registry=r)
        # created by the first check (absent while the certificate is off)
        self.certificate: Gauge | None = None
        self.certificate_solve_seconds: Gauge | None = None

    def decided(self, action: str, instance: str, seconds: float) -> None:
        """A decision: counted by action and instance, and its time."""
        self._child(self.decisions, action, instance).inc()
        self.decision_seconds.observe(seconds)

    def latency(self, instance: str, ttft_s: float, eel_s: float | None) -> None:
        """A served request's TTFT and, if its whole answer reached the client, its
        end-to-end latency."""
        self._child(self.ttft_seconds, instance).observe(ttft_s)
        if eel_s is not None:
            self._child(self.eel_seconds, instance).observe(eel_s)

    def _child(self, metric: Counter | Histogram, *labels: str) -> Any:
        key = (metric._name, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def set_shared(self, status: SharedStatus) -> None:
        """The shared state's gauges from its status (``olproute.server.shared``)."""
        self.shared_up.set(1.0 if status.status == "shared" else 0.0)
        self.shared_leader.set(1.0 if status.leader else 0.0)
        self.shared_replicas.set(status.replicas)
        self.shared_failures.set(status.failures)
        for key, n in status.rejected.items():
            self.shared_rejected.labels(*key).inc(n - self._rejected_seen.get(key, 0))
            self._rejected_seen[key] = n

    def set_price_sums(self, names: Sequence[str], prices: npt.NDArray[np.float64]) -> None:
        """Each instance's horizon-summed price of every resource (batch, kv, compute)
        from ``prices[g, k, r]`` (a policy's ``PriceView.prices``; a non-finite price
        counts 0, as ``Router.prices`` shows it)."""
        sums = np.where(np.isfinite(prices), prices, 0.0).sum(axis=1)
        for g, name in enumerate(names):
            for r, resource in enumerate(RESOURCES):
                self.price_sum.labels(name, resource).set(float(sums[g, r]))

    def set_certificate(self, check: dict[str, Any]) -> None:
        """A finished live check: counted by status; a successful one sets the gauges
        (which keep the last successful check's values)."""
        self.certificate_checks.labels(check["status"]).inc()
        cert, solve_s = check.get("certificate"), check.get("solve_s")
        if check["status"] != "ok" or cert is None or solve_s is None:
            return
        if self.certificate is None or self.certificate_solve_seconds is None:
            self.certificate = Gauge(
                "olproute_price_certificate", "D(p_online)/LP* - 1 of the last live check: "
                "how far the dual value of bid_price's prices is above the exact LP's "
                "optimum over the last window (>= 0; 0: the prices are optimal)",
                registry=self.registry)
            self.certificate_solve_seconds = Gauge(
                "olproute_price_certificate_solve_seconds", "Time the last live check's "
                "exact LP took to solve", registry=self.registry)
        self.certificate.set(float(cert))
        self.certificate_solve_seconds.set(float(solve_s))

    def resolved(self, outcome: str) -> None:
        """A re-solve's outcome (``olproute.server.resolving``), or a period skipped."""
        self._child(self.price_resolves, outcome).inc()

    def set_backends(self, names: Sequence[str], healthy: Sequence[bool],
                     in_flight: Sequence[int]) -> None:
        for name, ok, n in zip(names, healthy, in_flight, strict=True):
            self.backend_up.labels(name).set(1.0 if ok else 0.0)
            self.in_flight.labels(name).set(n)

    def set_prefix_index(self, names: Sequence[str], blocks: Sequence[int] | None) -> None:
        """The prefix index's blocks per backend (None: the router keeps no index)."""
        if blocks is None:
            return
        for name, n in zip(names, blocks, strict=True):
            self.prefix_index_blocks.labels(name).set(n)

    def set_kv_events(self, names: Sequence[str], exact: Sequence[bool] | None,
                      statuses: Sequence[dict[str, Any] | None]) -> None:
        """Each backend's index mode and, where it has a KV-events subscriber, the
        stream's age and counts (``KvSubscriber.status``)."""
        if exact is None:
            return
        for name, on in zip(names, exact, strict=True):
            self.prefix_index_exact.labels(name).set(1.0 if on else 0.0)
        for name, doc in zip(names, statuses, strict=False):
            if doc is None:
                continue
            if doc["age_s"] is not None:
                self.kv_events_age.labels(name).set(doc["age_s"])
            for what in ("batches", "gaps_replayed", "gaps_lost", "restarts"):
                self.kv_events.labels(name, what).set(doc[what])

    def set_engine_mismatch(self, name: str, mismatch: bool) -> None:
        self.engine_mismatch.labels(name).set(1.0 if mismatch else 0.0)

    def set_scraped(self, name: str, gauges: dict[str, float]) -> None:
        for gauge, value in gauges.items():
            self.backend_scraped.labels(name, gauge).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
