"""Prometheus instruments named like vLLM's (`vllm:` → `inferengine:`), fed by `AsyncLLM` stats.

Each logger owns its `CollectorRegistry`, so several servers (or tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inferengine.core.engine_io import SchedulerStats
from inferengine.metrics.stats import IterationStats, StatLogger

PREFIX = "inferengine:"
FINISH_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
TTFT_BUCKETS += [7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
ITL_BUCKETS += [7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0]
LATENCY_BUCKETS += [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TRANSFER_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
TRANSFER_BUCKETS += [30.0, 60.0]
TRANSFER_BYTES_BUCKETS = [float(4**i * 2**10) for i in range(14)]  # 1 KiB to 64 GiB


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            value = m * scale
            if value > limit:
                return out
            out.append(float(value))
        scale *= 10


def iteration_buckets(max_num_batched_tokens: int) -> list[float]:
    sizes = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    return [float(s) for s in sizes if s < max_num_batched_tokens] + [float(max_num_batched_tokens)]


class PrometheusStatLogger(StatLogger):
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: str = "cpu",
        registry: CollectorRegistry | None = None,
    ):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, names = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, names, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=r).labels(
                model_name
            )

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.gpu_memory = (
            gauge("gpu_memory_used_bytes", "Device memory used by the engine core.")
            if device == "cuda"
            else None
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.tier_counters = {
            "cpu_hit_tokens": counter(
                "kv_cpu_tier_hits", "Prompt tokens loaded from the CPU tier instead of recomputed."
            ),
            "offloaded_blocks": counter("kv_offloaded_blocks", "KV pages copied to the CPU tier."),
            "loaded_blocks": counter("kv_loaded_blocks", "KV pages loaded from the CPU tier."),
            "offloaded_bytes": counter("kv_offloaded_bytes", "Bytes copied to the CPU tier."),
            "loaded_bytes": counter("kv_loaded_bytes", "Bytes loaded from the CPU tier."),
            "leased_evicted_blocks": counter(
                "kv_leased_evicted_blocks", "Leased KV pages reused before their lease ended."
            ),
        }
        self.tier_gauges = {
            "leased_blocks": gauge("kv_leased_blocks", "Free GPU KV pages kept by a lease."),
            "leased_cpu_pages": gauge("kv_leased_cpu_pages", "CPU tier pages kept by a lease."),
            "sessions": gauge("kv_sessions", "Session keys with a live lease."),
            "cpu_pages_used": gauge("kv_cpu_pages_used", "CPU tier pages holding a prefix."),
        }
        self.spec_counters = {
            "num_drafts": counter("spec_decode_num_drafts", "Verify steps with drafts."),
            "num_draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens."),
            "num_accepted_tokens": counter(
                "spec_decode_num_accepted_tokens", "Draft tokens accepted."
            ),
        }
        self.spec_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            [*names, "position"],
            registry=r,
        )
        self.expert_tokens = Counter(
            PREFIX + "moe_expert_tokens",
            "Tokens routed to each expert of each mixture-of-experts layer (a token counts once "
            "for each of its top-k experts).",
            [*names, "layer", "expert"],
            registry=r,
        )
        self.transfer_counters = {
            "sent_tokens": counter(
                "kv_transfer_sent_tokens", "Prompt tokens whose KV pages a consumer took."
            ),
            "received_tokens": counter(
                "kv_transfer_received_tokens", "Prompt tokens whose KV pages came from a producer."
            ),
            "local_prefill_tokens": counter(
                "kv_transfer_local_prefill_tokens",
                "Prompt tokens of remote-prefill requests that this consumer computed itself.",
            ),
            "fallbacks": counter(
                "kv_transfer_fallback",
                "KV transfers that failed or timed out (the consumer recomputed the prompt).",
            ),
            "expired_holds": counter(
                "kv_transfer_expired_holds", "Held KV transfers freed by the hold timeout."
            ),
        }
        self.transfer_gauges = {
            "held_blocks": gauge("kv_transfer_held_blocks", "KV pages held for consumers."),
            "waiting_requests": gauge(
                "kv_transfer_waiting_requests", "Requests waiting for a producer's KV pages."
            ),
        }
        self.transfer_seconds = histogram(
            "kv_transfer_seconds", "Time of one KV fetch, seconds.", TRANSFER_BUCKETS
        )
        self.transfer_bytes = histogram(
            "kv_transfer_bytes", "Bytes of one KV fetch.", TRANSFER_BYTES_BUCKETS
        )
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens produced.")
        success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success = success
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token, seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens, seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to finish, seconds.", LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Time waiting before the first step.", LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "First step to first token.", LATENCY_BUCKETS
        )
        self.decode = histogram(
            "request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens scheduled in one engine step.",
            iteration_buckets(max_num_batched_tokens),
        )
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets
        )
        self.request_generation = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", token_buckets
        )
        self._totals: dict[str, int] = {}
        # Multi-LoRA, as vLLM names it: one series, labelled with the adapters now running and
        # waiting, whose value is when that last changed
        self.lora_info = Gauge(
            PREFIX + "lora_requests_info",
            "Running stats on LoRA requests.",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=r,
        )
        self._lora_labels: tuple[str, str, str] | None = None

    # ---- recording ---------------------------------------------------------------------------

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        if scheduler_stats is not None:
            self.update_scheduler_stats(scheduler_stats)
            if scheduler_stats.step_num_tokens:
                self.iteration_tokens.observe(scheduler_stats.step_num_tokens)
        if iteration.num_prompt_tokens:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.inc(iteration.num_generation_tokens)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
        for finished in iteration.finished:
            reason = finished.finish_reason
            child = self.success.get(reason) or self._success.labels(self.model_name, reason)
            child.inc()
            self.e2e.observe(finished.e2e_latency)
            self.queue.observe(finished.queue_time)
            self.prefill.observe(finished.prefill_time)
            self.decode.observe(finished.decode_time)
            self.request_prompt.observe(finished.num_prompt_tokens)
            self.request_generation.observe(finished.num_generation_tokens)

    def update_scheduler_stats(self, s: SchedulerStats) -> None:
        """Gauges from the newest stats; counters by how far the core's cumulative totals moved."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        for name, counter in (
            ("prefix_cache_queries", self.prefix_queries),
            ("prefix_cache_hits", self.prefix_hits),
            ("num_preemptions", self.preemptions),
        ):
            self._advance(name, getattr(s, name), counter)
        tiers = s.kv_tiers
        if tiers is not None:
            for name, counter in self.tier_counters.items():
                self._advance(f"tier_{name}", getattr(tiers, name), counter)
            for name, gauge in self.tier_gauges.items():
                gauge.set(getattr(tiers, name))
        if s.kv_transfer is not None:
            self._update_transfer(s)
        if s.lora is not None:
            labels = (",".join(s.lora.running), ",".join(s.lora.waiting), str(s.lora.max_lora))
            if labels != self._lora_labels:
                if self._lora_labels is not None:
                    self.lora_info.remove(*self._lora_labels)
                self.lora_info.labels(*labels).set_to_current_time()
                self._lora_labels = labels
        spec = s.spec_decoding
        if spec is not None:
            for name, counter in self.spec_counters.items():
                self._advance(f"spec_{name}", getattr(spec, name), counter)
            for pos, total in enumerate(spec.num_accepted_tokens_per_pos):
                child = self.spec_per_pos.labels(self.model_name, str(pos))
                self._advance(f"spec_pos_{pos}", total, child)

    def _update_transfer(self, s: SchedulerStats) -> None:
        transfer = s.kv_transfer
        assert transfer is not None
        for name, counter in self.transfer_counters.items():
            self._advance(f"transfer_{name}", getattr(transfer, name), counter)
        for name, gauge in self.transfer_gauges.items():
            gauge.set(getattr(transfer, name))
        seen = self._totals.get("transfer_seq", 0)
        for seq, seconds, nbytes in transfer.recent:
            if seq > seen:
                self.transfer_seconds.observe(seconds)
                self.transfer_bytes.observe(nbytes)
                self._totals["transfer_seq"] = seq

    def _advance(self, key: str, now: int, counter) -> None:
        before = self._totals.get(key, 0)
        if now > before:  # stats can arrive out of order (refresh vs. outputs): never go back
            counter.inc(now - before)
            self._totals[key] = now

    def update_expert_token_counts(self, counts: dict[int, list[int]]) -> None:
        """Advance the expert counters to the engine's cumulative per-layer counts."""
        for layer, per_expert in counts.items():
            for expert, total in enumerate(per_expert):
                child = self.expert_tokens.labels(self.model_name, str(layer), str(expert))
                self._advance(f"expert_{layer}_{expert}", total, child)

    def set_gpu_memory_used(self, used_bytes: int) -> None:
        if self.gpu_memory is not None:
            self.gpu_memory.set(used_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
