"""`Request`: one sequence's state as the scheduler sees it (token ids, progress, status)."""

from __future__ import annotations

import time
from enum import IntEnum

from inferengine.core.hashing import BlockHasher
from inferengine.lora.request import LoRARequest, adapter_id
from inferengine.pooling_params import PoolingParams
from inferengine.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1  # holds pages that another engine's KV is being copied into
    RUNNING = 2
    PREEMPTED = 3
    # Every finished state sorts after PREEMPTED, so `is_finished` is one comparison.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class FinishReason(IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self]


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Token ids and progress of one sequence.

    `num_computed_tokens` counts tokens whose KV is in the cache; `num_tokens` counts all known
    tokens (prompt + output). The scheduler hands out the difference, chunk by chunk.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        block_hasher: BlockHasher | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        cache_key: str | None = None,
        cache_ttl_s: float | None = None,
        cache_breakpoints: list[tuple[int, float]] | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # Multi-LoRA: the adapter; its id keys the first block's hash, so adapters share no KV
        self.lora_request = lora_request
        self.lora_int_id = adapter_id(lora_request)
        # Session retention: leases on this request's pages once it ends (retention.py).
        self.cache_key = cache_key
        self.cache_ttl_s = cache_ttl_s
        self.cache_breakpoints = cache_breakpoints or []
        # Disaggregated prefill/decode (`kv_transfer/`): what the router asked of this engine
        self.kv_transfer_params = kv_transfer_params
        self.kv_fetch_done = False  # a consumer fetches a request's pages once
        self.pooling_params = pooling_params  # prompt-only: ends after prefill, pooled
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens being sampled by launched steps whose results have not come back yet (async
        # scheduling schedules the next step before the last one's tokens are known).
        self.num_output_placeholders = 0
        self.num_output_tokens_sent = 0  # output tokens the workers were told of (pipelining)
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Timestamps for request metrics: entering the scheduler, first being scheduled.
        self.queued_time = time.time()
        self.scheduled_time: float | None = None
        self.first_output_sent = False
        self.max_tokens = sampling_params.max_tokens or 2**31
        self._block_hasher = block_hasher
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self._block_hasher.extend(self)

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower `priority` first, then earlier arrival (for the waiting heap)."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
