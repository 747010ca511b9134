"""The router's own Prometheus families, `inferengine:router_*` (the engines keep their own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from inferengine.dp.pd_policy import PDPolicy
from inferengine.entrypoints.router.upstreams import Upstreams

PREFIX = "inferengine:"  # as metrics/prometheus.py names every family

# Why a request was decoded without the prefill engine's KV pages (the decode engine computed
# its prompt itself).
FALLBACK_REASONS = (
    "prefill_failed",  # every prefill engine tried failed or none was up
    "prefill_refused",  # a prefill engine answered 4xx (the decode engine's answer is the one)
    "no_kv_params",  # the prefill engine answered without kv_transfer_params
    "decode_retried",  # a decode engine that may have taken the pages failed; the next one
    # computed the prompt
    "unsupported",  # n > 1, several prompts, echo with logprobs: sent whole to a decode engine
)
# Why the router itself answered a request with an error.
ERROR_REASONS = ("no_decode_engine", "decode_failed", "stream_broken")


class RouterMetrics:
    def __init__(self, upstreams: Upstreams, policy: PDPolicy):
        self.upstreams = upstreams
        self.policy = policy
        r = self.registry = CollectorRegistry()
        by_engine = ["role", "url"]
        self.requests = Counter(
            PREFIX + "router_requests",
            "Requests sent to each engine (every try counts).",
            by_engine,
            registry=r,
        )
        self.failures = Counter(
            PREFIX + "router_upstream_failures",
            "Tries that failed at an engine: unreachable, timed out, 5xx or 429, or a broken "
            "stream.",
            by_engine,
            registry=r,
        )
        self.retries = Counter(
            PREFIX + "router_retries",
            "Requests sent to another engine of the same role after one failed.",
            ["role"],
            registry=r,
        )
        self.fallbacks = Counter(
            PREFIX + "router_fallbacks",
            "Requests decoded without transferred KV pages (the decode engine computed the "
            "prompt), by reason.",
            ["reason"],
            registry=r,
        )
        self.transfers = Counter(
            PREFIX + "router_kv_transfers",
            "Requests sent to a decode engine with a prefill engine's kv_transfer_params.",
            registry=r,
        )
        self.errors = Counter(
            PREFIX + "router_errors",
            "Requests the router ended with an error of its own (a 5xx, or an error event in "
            "a stream that had started), by reason.",
            ["reason"],
            registry=r,
        )
        self.prefill_decisions = Counter(
            PREFIX + "router_prefill_decisions",
            "Prefill engines picked, by why (prefix, load, session, round_robin).",
            ["reason"],
            registry=r,
        )
        self.up = Gauge(
            PREFIX + "router_engine_up",
            "1 while the engine answers /health.",
            by_engine,
            registry=r,
        )
        self.in_flight = Gauge(
            PREFIX + "router_requests_in_flight",
            "Requests at each engine through this router, not finished.",
            by_engine,
            registry=r,
        )
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)
        for reason in ERROR_REASONS:
            self.errors.labels(reason)
        for engine in upstreams.all:
            self.requests.labels(engine.role, engine.url)
            self.failures.labels(engine.role, engine.url)
        for role in ("prefill", "decode"):
            self.retries.labels(role)

    def render(self) -> bytes:
        for engine in self.upstreams.prefill:
            replica = self.policy.prefill.replicas[engine.index]
            self.up.labels(engine.role, engine.url).set(float(engine.up))
            self.in_flight.labels(engine.role, engine.url).set(replica.in_flight)
        for engine in self.upstreams.decode:
            view = self.policy.decode[engine.index]
            self.up.labels(engine.role, engine.url).set(float(engine.up))
            self.in_flight.labels(engine.role, engine.url).set(view.in_flight)
        return generate_latest(self.registry)
