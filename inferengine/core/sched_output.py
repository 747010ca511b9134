"""`SchedulerOutput`: what one step runs, as plain data (no tensors). Every worker gets the same.

A request goes to the workers in full once (`NewRequestData`, again after a preemption), then
only as changes (`CachedRequestData`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferengine.lora.request import LoRARequest
from inferengine.pooling_params import PoolingParams
from inferengine.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after a preemption
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None  # the adapter the worker runs it with
    pooling_params: PoolingParams | None = None


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Tokens sampled since the request was last scheduled; filled only under pipeline
    # parallelism, where the stages before the last never see the sampler's output.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVFetch:
    """Disaggregated decode: copy a producer's pages `remote_block_ids` into this engine's
    `block_ids` (allocated ahead); `params` is the producer's `kv_transfer_params`."""

    req_id: str
    params: dict
    remote_block_ids: list[int]
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # per request, in batch order
    total_num_scheduled_tokens: int
    # Requests that ended or were preempted since the last step: workers drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # CPU tier copies, run before the step in this order: (GPU page, host slot) saves, then
    # (host slot, GPU page) loads; write-backs (GPU page, host slot) of pages free in this step
    # may overlap it and are done before the next.
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    kv_writebacks: list[tuple[int, int]] = field(default_factory=list)
    # Structured output: the sampling requests under a grammar, and their allowed tokens
    # packed 32 per int32 word (row-major, one row per request, in this order).
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: bytes = b""
    # The masks come later (`StepHandle.provide_grammar`): they need the previous step's
    # tokens, which the engine core folds in while this step's forward runs.
    grammar_deferred: bool = False
    # Disaggregated prefill/decode (`kv_transfer/`): fetches to start before this step, and
    # requests whose prompt pages this step completes: request -> pages to publish
    kv_fetches: list[KVFetch] = field(default_factory=list)
    kv_publishes: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What the worker sends back: sampled token ids per request, in `req_ids` order."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # empty list: no token (a prefill chunk mid-prompt)
    logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(
        default_factory=dict
    )
    # req -> (token ids, logprobs, ranks, first prompt position) for a chunk of prompt positions
    prompt_logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int], int]] = field(
        default_factory=dict
    )
    # KV transfer events the worker saw since the last step (`worker/kv_connector.py`)
    kv_events: KVTransferEvents | None = None
    # Pooling requests whose prompt this step finished: req -> vector (float32 bytes)
    pooled: dict[str, bytes] = field(default_factory=dict)


@dataclass
class KVTransferEvents:
    """published: request -> the transport's part of its `kv_transfer_params` (None: failed);
    released: producer transfers done with (the consumer took the pages, or they expired);
    fetched: request -> (ok, seconds, bytes) of each finished fetch."""

    published: dict[str, dict | None] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    fetched: dict[str, tuple[bool, float, int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.published or self.released or self.expired or self.fetched)
