"""What crosses the engine-core boundary: token ids and sampling parameters in, new token ids out.

msgspec structs, so the same objects serve the in-process client and the ZMQ one. Never text.
"""

from __future__ import annotations

import msgspec

from inferengine.lora.request import LoRARequest, LoRAStats
from inferengine.pooling_params import PoolingParams
from inferengine.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # Multi-LoRA: the adapter; None: the base model
    # Session retention (`retention.py`): the session's name, a lease in seconds on every
    # page of the request (prompt and output) once it ends, and Anthropic-style breakpoints:
    # (number of leading prompt tokens, lease in seconds).
    cache_key: str | None = None
    cache_ttl_s: float | None = None
    cache_breakpoints: list[tuple[int, float]] = []
    # Disaggregated prefill/decode: the router's `kv_transfer_params` (`kv_transfer/`)
    kv_transfer_params: dict | None = None
    # A prompt-only pooling request (embeddings): it ends after its prefill with `pooled` set
    pooling_params: PoolingParams | None = None


class LogprobsLists(msgspec.Struct, array_like=True):
    """Per position: `token_ids[i][0]` is the chosen token, then the top-N in order."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the chosen token in the full distribution (1 = most likely)
    start: int = 0  # prompt logprobs: the prompt position whose logits give the first row


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None  # a `FinishReason`
    stop_reason: int | str | None = None  # the stop token id, when one ended the request
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    # On a request's first output only: when the core queued it and first scheduled it.
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    # A producer's finished request: where a consumer fetches its prompt's KV pages
    kv_transfer_params: dict | None = None
    # A pooling request's vector: float32 little-endian bytes
    pooled: bytes | None = None


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    """Cumulative speculative-decoding counts, under vLLM's metric names."""

    num_drafts: int = 0  # verify steps of one request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def add(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft:
            self.num_accepted_tokens_per_pos += [0] * (
                num_draft - len(self.num_accepted_tokens_per_pos)
            )
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: the accepted drafts plus the one sampled after."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class KVTierStats(msgspec.Struct, omit_defaults=True):
    """The KV cache's tiers and sessions; counts are cumulative, pages and sessions current."""

    query_tokens: int = 0  # prompt tokens looked up
    gpu_hit_tokens: int = 0  # found in the GPU pool
    cpu_hit_tokens: int = 0  # found in the CPU tier only (loaded back)
    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    offloaded_bytes: int = 0
    loaded_bytes: int = 0
    cpu_pages_total: int = 0
    cpu_pages_used: int = 0
    leased_blocks: int = 0  # free GPU pages kept by a live lease
    leased_cpu_pages: int = 0
    sessions: int = 0  # session keys with a live lease
    leased_evicted_blocks: int = 0  # leased pages reused anyway (GPU and CPU)


class KVTransferStats(msgspec.Struct, omit_defaults=True):
    """Disaggregated prefill/decode (`kv_transfer/`); counts cumulative, the rest current."""

    sent_tokens: int = 0  # producer: prompt tokens whose pages a consumer took (or were pushed)
    sent_transfers: int = 0
    expired_holds: int = 0  # producer: transfers whose pages were freed by the hold timeout
    held_blocks: int = 0  # producer: pages kept for consumers now
    received_tokens: int = 0  # consumer: prompt tokens loaded from a producer
    received_transfers: int = 0
    local_prefill_tokens: int = (
        0  # consumer: prompt tokens of remote-prefill requests computed here
    )
    fallbacks: int = 0  # consumer: transfers that failed or timed out (prompt recomputed)
    waiting_requests: int = 0  # consumer: requests waiting for their pages now
    # The newest finished receives: (sequence number, seconds, bytes), for histograms
    recent: list[tuple[int, float, int]] = []


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_free_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative
    prefix_cache_hits: int = 0  # cumulative
    num_preemptions: int = 0  # cumulative
    step_num_tokens: int = 0  # tokens scheduled in the last step
    spec_decoding: SpecDecodingStats | None = None
    kv_tiers: KVTierStats | None = None
    kv_transfer: KVTransferStats | None = None
    lora: LoRAStats | None = None  # Multi-LoRA: adapters running and waiting


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Set when the core failed a request on its own (bad input that slipped through).
    errors: dict[str, str] = {}
