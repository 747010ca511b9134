"""`Scheduler`: one token budget per step, handed to running requests first, then waiting ones.

There is no prefill or decode phase: every request has `num_computed_tokens` and `num_tokens`,
and a step gives it up to the difference. Chunked prefill, prefix-cache hits, decodes and
speculative tokens all follow from that rule. When pages run out, the lowest-priority running
request is preempted (pages freed, recomputed later).

Keep this file free of tensors and of anything about how the model runs.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable

from inferengine.config import CacheConfig, KVTransferConfig, SchedulerConfig
from inferengine.core.engine_io import (
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsLists,
    SchedulerStats,
    SpecDecodingStats,
)
from inferengine.core.hashing import BlockHasher
from inferengine.core.kv_cache_manager import KVCacheManager
from inferengine.core.kv_connector import KVConnectorScheduler
from inferengine.core.request import Request, RequestStatus
from inferengine.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from inferengine.lora.request import admits_adapter, lora_stats


class WaitingQueue:
    """FCFS: a deque (preempted requests go back to the front). Priority: a heap."""

    def __init__(self, policy: str):
        self.policy = policy
        self._items: deque[Request] | list[Request] = deque() if policy == "fcfs" else []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._items.append(request)
        else:
            heapq.heappush(self._items, request)

    def add_front(self, request: Request) -> None:
        """A preempted request: first in line under FCFS, by its priority otherwise."""
        if self.policy == "fcfs":
            self._items.appendleft(request)
        else:
            heapq.heappush(self._items, request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        if self.policy == "fcfs":
            return self._items.popleft()
        return heapq.heappop(self._items)

    def remove(self, requests: set[Request]) -> None:
        kept = [r for r in self._items if r not in requests]
        if self.policy == "fcfs":
            self._items = deque(kept)
        else:
            heapq.heapify(kept)
            self._items = kept


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        pipeline_stages: int = 1,
        keep_finished: bool = False,
        kv_page_bytes: int = 0,
        kv_transfer_config: KVTransferConfig | None = None,
    ):
        """`pipeline_stages`: pipeline-parallel stages (more than one: steps in flight over
        disjoint requests); `keep_finished`: keep ended requests in `just_finished` for the
        speculation room; `kv_page_bytes`: one KV page's bytes over all ranks (tier stats);
        `kv_transfer_config`: disaggregated prefill/decode (`core/kv_connector.py`)."""
        self.config = scheduler_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.num_host_blocks,
        )
        self.block_hasher = BlockHasher(cache_config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._last_step_tokens = 0
        self.spec_stats = SpecDecodingStats()
        # Requests that ended, kept for the speculation room when it asks
        self.keep_finished = keep_finished
        self.just_finished: list[Request] = []
        # (request id, drafts verified, drafts accepted) of the last update, for the draft policy
        self.last_verified: list[tuple[str, int, int]] = []
        # Pipeline parallelism (`pipelined`) keeps steps in flight over disjoint requests: a
        # request whose sampled token is still on its way waits for it (the first stage cannot
        # take it from the last stage's device), and workers learn each request's new tokens
        # from the next step that schedules it. With `pipeline_depth` steps in flight, each
        # takes about 1/depth of the requests so that every stage has work.
        self.pipelined = pipeline_stages > 1
        self.pipeline_depth = pipeline_stages
        self.kv_page_bytes = kv_page_bytes
        self.kv_connector = KVConnectorScheduler(kv_transfer_config, self.kv_cache_manager)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request._block_hasher is None and self.kv_cache_manager.enable_caching:
            request._block_hasher = self.block_hasher
            request._update_block_hashes()
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort, or a stop string found by the output processor)."""
        assert status.is_finished
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                request.status = status  # freed once the worker is done with its pages
                finished.append(request)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove({request})
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.kv_connector.loading)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.kv_connector.loading)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self, steps_in_flight: int | None = None) -> SchedulerOutput:
        """The next step. Pipelined, each of `steps_in_flight` steps (default: one per stage)
        takes about 1/depth of the requests; otherwise the argument changes nothing."""
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        preempted_any = False
        depth = (steps_in_flight or self.pipeline_depth) if self.pipelined else 1
        seq_cap = self._step_seq_cap(depth)
        kv = self.kv_cache_manager
        kv.expire_leases()
        self.kv_connector.expire_holds()

        for request in list(self.running):
            if budget <= 0 or len(num_scheduled) >= seq_cap:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, budget)
            if num_new <= 0:
                continue
            self._trim_drafts(request, num_new)
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                if request.spec_token_ids:  # drop the drafts before preempting anyone
                    num_new -= len(request.spec_token_ids)
                    request.spec_token_ids = []
                    continue
                victim = self._pick_victim()
                budget += num_scheduled.pop(victim.request_id, 0)
                new_block_ids.pop(victim.request_id, None)
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:
                continue
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
            budget -= num_new

        scheduled_new: list[Request] = []
        while (
            not preempted_any
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and len(num_scheduled) < seq_cap
        ):
            request = self.waiting.peek()
            if not admits_adapter(request.lora_request, self.running, self.config.max_loras):
                break  # --max-loras adapters run; this one waits for one of them to end
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            if self.kv_connector.wants_fetch(request):
                parked = self.kv_connector.start_fetch(request, hits)
                if parked is None:
                    break
                if parked:
                    self.waiting.pop()
                    continue
            if request.num_computed_tokens:  # holds pages fetched from another engine
                hits, num_hit_tokens, host_hits = [], 0, []
            else:
                host_hits = kv.get_host_hits(request, len(hits))
            num_hit_tokens += len(host_hits) * self.block_size
            num_computed = request.num_computed_tokens + num_hit_tokens
            num_new = min(request.num_tokens - num_computed, self._chunk_cap(budget))
            if num_new < request.num_tokens - num_computed and _whole_prompt(request):
                break  # an encoder's prompt runs in one step: it waits for one with room
            new_blocks = kv.allocate_slots(request, num_new, hits, num_hit_tokens, host_hits)
            if new_blocks is None:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                request.scheduled_time = time.time()
                kv.record_lookup(request.num_tokens, len(hits), len(host_hits))
                self.kv_connector.admitted(request)
            self.running.append(request)
            scheduled_new.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        return self._make_output(scheduled_new, num_scheduled, new_block_ids)

    def _make_output(
        self,
        scheduled_new: list[Request],
        num_scheduled: dict[str, int],
        new_block_ids: dict[str, list[int]],
    ) -> SchedulerOutput:
        new_ids = {r.request_id for r in scheduled_new}
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                eos_token_id=r.eos_token_id,
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                lora_request=r.lora_request,
                pooling_params=r.pooling_params,
            )
            for r in scheduled_new
        ]
        cached_reqs = [
            CachedRequestData(
                req_id=req_id,
                new_block_ids=new_block_ids[req_id],
                num_computed_tokens=self.requests[req_id].num_computed_tokens,
                new_token_ids=self._unsent_tokens(self.requests[req_id]),
            )
            for req_id in num_scheduled
            if req_id not in new_ids
        ]
        total = sum(num_scheduled.values())
        drafts = {
            req_id: list(self.requests[req_id].spec_token_ids)
            for req_id in num_scheduled
            if self.requests[req_id].spec_token_ids
        }
        offloads, loads, writebacks = self.kv_cache_manager.end_step()
        fetches, publishes = self.kv_connector.step_work(num_scheduled, self.requests)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=drafts,
            kv_offloads=offloads,
            kv_loads=loads,
            kv_writebacks=writebacks,
            kv_fetches=fetches,
            kv_publishes=publishes,
        )
        self.finished_req_ids = set()
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_output_tokens_sent = request.num_output_tokens
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token
        self._last_step_tokens = total
        return output

    def _step_seq_cap(self, depth: int) -> int:
        if depth == 1:
            return self.max_num_seqs
        share = -(-(len(self.running) + len(self.waiting)) // depth)
        return max(1, min(share, self.max_num_seqs))

    def _unsent_tokens(self, request: Request) -> list[int]:
        if not self.pipelined:
            return []
        return request.output_token_ids[request.num_output_tokens_sent :]

    def _chunk_cap(self, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        return min(budget, threshold) if threshold > 0 else budget

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        pending = request.num_output_placeholders
        if pending and self.pipelined:
            return 0
        if pending and (
            request.num_output_tokens + pending >= request.max_tokens
            or request.num_tokens + pending >= self.max_model_len
        ):
            return 0  # its last token is already on its way
        known = request.num_tokens_with_spec + pending
        limit = self.max_model_len - request.num_computed_tokens
        return min(known - request.num_computed_tokens, limit, self._chunk_cap(budget))

    def _trim_drafts(self, request: Request, num_new: int) -> None:
        """Keep only the drafts that fit in this step's `num_new` tokens (they follow the known
        tokens and any on their way)."""
        if request.spec_token_ids:
            first_draft = request.num_tokens + request.num_output_placeholders
            fit = request.num_computed_tokens + num_new - first_draft
            del request.spec_token_ids[max(fit, 0) :]

    def allocate_lookahead(self, request: Request, num_drafts: int) -> list[int] | None:
        """Pages for `request`'s next token and the `num_drafts` drafts a draft model writes
        before the step that verifies them: the page ids added, or None when too few are free
        (no drafts then, never a preemption)."""
        new_blocks = self.kv_cache_manager.allocate_slots(request, 1 + num_drafts)
        return None if new_blocks is None else [b.block_id for b in new_blocks]

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(request.request_id)
        self.waiting.add_front(request)

    # ---- after the model ran ---------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        self.last_verified = []
        for request in self.kv_connector.update(runner_output.kv_events):
            if request.is_finished:  # aborted while its pages were coming
                self._free(request)
            else:
                self.waiting.add_front(request)
        index = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            sampled = runner_output.sampled_token_ids[index[req_id]] if req_id in index else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts is not None and sampled:
                # The KV of rejected drafts is stale: compute from the first of them again.
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                request.spec_token_ids = []
                self.spec_stats.add(len(drafts), len(sampled) - 1)
                self.last_verified.append((req_id, len(drafts), len(sampled) - 1))
            if sampled:
                request.num_output_placeholders = max(
                    0, request.num_output_placeholders - len(sampled)
                )
            new_tokens = self._append_and_check_stop(request, sampled)
            prompt_lp = runner_output.prompt_logprobs.get(req_id)
            if not new_tokens and prompt_lp is None:
                continue
            logprobs = runner_output.logprobs.get(req_id)
            output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_tokens,
                finish_reason=request.finish_reason,
                stop_reason=request.stop_reason,
                new_logprobs=LogprobsLists(*logprobs) if logprobs and new_tokens else None,
                new_prompt_logprobs=LogprobsLists(*prompt_lp) if prompt_lp else None,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                pooled=runner_output.pooled.get(req_id),
            )
            if not request.first_output_sent:
                request.first_output_sent = True
                output.queued_time = request.queued_time
                output.scheduled_time = request.scheduled_time or 0.0
            outputs.append(output)
            if request.is_finished:
                output.kv_transfer_params = self._free(request)
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.time()
        )

    def _append_and_check_stop(self, request: Request, sampled: list[int]) -> list[int]:
        """Append sampled tokens one by one, stopping at the first that ends the request."""
        params = request.sampling_params
        accepted = []
        for token_id in sampled:
            request.append_output_token_ids([token_id])
            accepted.append(token_id)
            n_out = request.num_output_tokens
            if n_out >= params.min_tokens:
                if not params.ignore_eos and token_id == request.eos_token_id:
                    request.status = RequestStatus.FINISHED_STOPPED
                elif token_id in params.all_stop_token_ids:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = token_id
            if not request.is_finished and (
                n_out >= request.max_tokens or request.num_tokens >= self.max_model_len
            ):
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            if request.is_finished:
                if request in self.running:
                    self.running.remove(request)
                else:  # preempted while its last token was on its way
                    self.waiting.remove({request})
                break
        return accepted

    def _free(self, request: Request) -> dict | None:
        """Release an ended request; a producer's `kv_transfer_params` for it, if any."""
        params = self.kv_connector.request_finished(request)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        if self.keep_finished:
            self.just_finished.append(request)
        return params

    # ---- stats -------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        pool = self.kv_cache_manager.pool
        prefix = self.kv_cache_manager.prefix_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=pool.usage,
            num_blocks=pool.num_usable_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            step_num_tokens=self._last_step_tokens,
            spec_decoding=self.spec_stats if self.spec_stats.num_drafts else None,
            kv_tiers=self.kv_cache_manager.tier_stats(self.kv_page_bytes),
            kv_transfer=self.kv_connector.make_stats(),
            lora=lora_stats(self.running, self.waiting, self.config.max_loras),
        )


def _whole_prompt(request: Request) -> bool:
    return request.pooling_params is not None and request.pooling_params.bidirectional
