"""`AsyncLLM`: the engine for the server: async streams of `RequestOutput`s per request.

The engine core runs in its own process. One output-handler task reads its outputs, turns them
into `RequestOutput`s and puts each into its request's single-slot collector (merging deltas
when the consumer lags). A caller that stops listening aborts its request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from inferengine.config import EngineConfig
from inferengine.core.engine_io import KVTransferStats, SchedulerStats, SpecDecodingStats
from inferengine.engine.core_client import AsyncMPClient
from inferengine.engine.input_processor import InputProcessor, PromptType
from inferengine.engine.llm_engine import fan_out
from inferengine.engine.output_processor import OutputProcessor
from inferengine.errors import EngineDeadError, InvalidRequestError, OverloadedError
from inferengine.logger import init_logger
from inferengine.lora.checker import adapter_checker
from inferengine.lora.request import LoRARequest
from inferengine.metrics.stats import IterationStats, StatLogger, ThroughputWindow
from inferengine.outputs import RequestOutput
from inferengine.pooling_params import PoolingParams
from inferengine.retention import Retention
from inferengine.sampling_params import RequestOutputKind, SamplingParams
from inferengine.tokenizer import load_tokenizer

logger = init_logger(__name__)


class RequestCollector:
    """Holds the newest output of one request; deltas that pile up are merged into one."""

    def __init__(self, kind: RequestOutputKind):
        self.kind = kind
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException) or self.output is None:
            self.output = item
        elif isinstance(self.output, RequestOutput):
            if self.kind == RequestOutputKind.DELTA:
                _merge_delta(self.output, item)
            else:
                self.output = item
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        item = self.output
        self.output = None
        self.ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for completion in new.outputs:
        old = by_index.get(completion.index)
        if old is None:
            into.outputs.append(completion)
            continue
        old.text += completion.text
        old.token_ids = old.token_ids + completion.token_ids
        if completion.logprobs is not None:
            old.logprobs = (old.logprobs or []) + completion.logprobs
        old.cumulative_logprob = completion.cumulative_logprob
        old.finish_reason, old.stop_reason = completion.finish_reason, completion.stop_reason
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.error = new.error or into.error
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None):
        self.config = config
        self.model_config = config.model_config
        # The engine core starts first: it loads while this process reads the tokenizer.
        self.client = self._make_client(config)
        try:
            self.tokenizer = load_tokenizer(
                config.model_config.tokenizer or config.model_config.model_path
            )
        except BaseException:
            self.client.shutdown()
            raise
        self.input_processor = InputProcessor(
            config.model_config, self.tokenizer, config.scheduler_config.policy
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor.lora = adapter_checker(config)
        self.stat_loggers = list(stat_loggers or [])
        self.collectors: dict[str, RequestCollector] = {}
        self.children: dict[str, list[str]] = {}  # parent id -> core request ids
        self.scheduler_stats = SchedulerStats()
        self.throughput = ThroughputWindow()
        self.start_time = time.time()
        self.ready_info: dict[str, Any] = {}
        self._handler: asyncio.Task | None = None

    def _make_client(self, config: EngineConfig) -> Any:
        """The engine-core client: one process here; `DataParallelLLM` gives its replicas'."""
        return AsyncMPClient(config)

    async def start(self) -> None:
        """Wait until the engine core serves."""
        self.ready_info = await self.client.wait_until_ready()
        self.scheduler_stats.num_blocks = self.ready_info.get("num_blocks", 0)
        if "max_model_len" in self.ready_info:  # the core lowers it to what its cache holds
            max_len = int(self.ready_info["max_model_len"])
            self.config.scheduler_config.max_model_len = max_len
            self.model_config.max_model_len = max_len
        self._handler = asyncio.create_task(self._output_handler())

    # ---- health ------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return bool(self.ready_info) and not self.client.is_dead

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.collectors)

    # ---- requests ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        retention: Retention | None = None,
        kv_transfer_params: dict | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream outputs of one request; leaving the loop early aborts it in the engine."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self.dead_reason}).")
        if request_id in self.collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already in use.")
        self._check_capacity()
        text, token_ids = self.input_processor.tokenize(prompt)
        collector = RequestCollector(params.output_kind)
        core_requests = fan_out(
            self.input_processor,
            self.output_processor,
            request_id,
            text,
            token_ids,
            params,
            priority,
            cache_salt,
            retention,
            kv_transfer_params,
            pooling_params,
            lora_request=lora_request,
        )
        self.collectors[request_id] = collector
        self.children[request_id] = [r.request_id for r in core_requests]
        finished = False
        try:
            for request in core_requests:
                await self.client.add_request(request)
            while True:
                output = await collector.get()
                finished = output.finished
                yield output
                if finished:
                    break
        finally:
            self.collectors.pop(request_id, None)
            sub_ids = self.children.pop(request_id, [])
            if not finished:
                await self.abort(sub_ids)

    def _check_capacity(self) -> None:
        limit = self.config.scheduler_config.max_waiting_requests
        if limit is None:
            return
        capacity = self.config.scheduler_config.max_num_seqs + limit
        if len(self.collectors) >= capacity:
            raise OverloadedError(
                f"the server is at capacity ({capacity} requests in flight); retry shortly."
            )

    async def abort(self, request_ids: list[str]) -> None:
        stats = IterationStats()
        self.output_processor.abort(request_ids, stats)
        if stats.finished:  # request_success_total{finished_reason="abort"}, as in vLLM
            for stat_logger in self.stat_loggers:
                stat_logger.record(None, stats)
        await self.client.abort_requests(request_ids)

    # ---- the output handler ------------------------------------------------------------

    async def _output_handler(self) -> None:
        try:
            while True:
                core_outputs = await self.client.get_output()
                stats = IterationStats()
                outputs, to_abort = self.output_processor.process_outputs(
                    core_outputs.outputs, core_outputs.errors, stats
                )
                for output in outputs:
                    collector = self.collectors.get(output.request_id)
                    if collector is not None:
                        collector.put(output)
                if to_abort:
                    await self.client.abort_requests(to_abort)
                if core_outputs.scheduler_stats is not None:
                    self.scheduler_stats = core_outputs.scheduler_stats
                self.throughput.add(stats)
                for stat_logger in self.stat_loggers:
                    stat_logger.record(core_outputs.scheduler_stats, stats)
        except EngineDeadError as e:
            for collector in list(self.collectors.values()):
                collector.put(e)
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("output handler failed")
            error = EngineDeadError(f"the output handler failed: {e}")
            for collector in list(self.collectors.values()):
                collector.put(error)

    # ---- stats and utilities -----------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        s = self.scheduler_stats
        prompt_rate, generation_rate = self.throughput.rates()
        used = s.num_blocks - s.num_free_blocks if s.num_blocks else 0
        return {
            "model": self.model_config.name,
            "device": self.config.device,
            "attention_backend": self.ready_info.get("attention_backend"),
            "attention_backend_timings_ms": self.ready_info.get("attention_backend_timings_ms", {}),
            "uptime_s": round(time.time() - self.start_time, 3),
            "engine_running": self.is_running,
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "num_requests_in_flight": len(self.collectors),
            "kv_pages_total": s.num_blocks,
            "kv_pages_used": used,
            "kv_pages_free": s.num_free_blocks,
            "kv_pages_cached": s.num_cached_free_blocks,
            "kv_cache_usage": round(s.kv_cache_usage, 6),
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": round(s.prefix_cache_hits / s.prefix_cache_queries, 6)
            if s.prefix_cache_queries
            else 0.0,
            "num_preemptions": s.num_preemptions,
            "kv_tiers": msgspec.to_builtins(s.kv_tiers) if s.kv_tiers is not None else None,
            "kv_transfer": _transfer_stats(s.kv_transfer),
            "spec_decoding": _spec_stats(s.spec_decoding),
            "prompt_tokens_per_s": round(prompt_rate, 3),
            "generation_tokens_per_s": round(generation_rate, 3),
        }

    async def refresh_stats(self) -> None:
        """Ask the core for fresh scheduler stats (they otherwise arrive with outputs)."""
        if self.is_running:
            raw = await self.client.call_utility("get_stats")
            self.scheduler_stats = msgspec.convert(raw, SchedulerStats)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility("reset_prefix_cache"))

    def shutdown(self) -> None:
        if self._handler is not None:
            self._handler.cancel()
        self.client.shutdown()


def _transfer_stats(stats: KVTransferStats | None) -> dict | None:
    """Disaggregated prefill/decode so far (`kv_transfer/`), without the histograms' feed."""
    if stats is None:
        return None
    return {name: getattr(stats, name) for name in stats.__struct_fields__ if name != "recent"}


def _spec_stats(spec: SpecDecodingStats | None) -> dict | None:
    """Speculative decoding so far, under vLLM's counter names, with the rates derived."""
    if spec is None:
        return None
    return {
        "spec_decode_num_drafts": spec.num_drafts,
        "spec_decode_num_draft_tokens": spec.num_draft_tokens,
        "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
        "spec_decode_num_accepted_tokens_per_pos": list(spec.num_accepted_tokens_per_pos),
        "acceptance_rate": round(spec.acceptance_rate, 6),
        "mean_accepted_length": round(spec.mean_accepted_length, 6),
    }
