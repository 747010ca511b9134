"""`EngineCore`: the step loop: schedule, execute, update. Token ids in, token ids out.

Runs in-process (for `LLM` and tests) or in its own process behind `core_client` (the server).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from inferengine import envs
from inferengine.config import EngineConfig
from inferengine.core.engine_io import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from inferengine.core.request import FinishReason, Request, RequestStatus
from inferengine.core.sched_output import SchedulerOutput
from inferengine.core.scheduler import Scheduler
from inferengine.engine.kv_sizing import check_capacity, host_tier_size
from inferengine.engine.step_timer import StepTimer
from inferengine.executor.base import make_executor
from inferengine.logger import init_logger
from inferengine.spec_decode.coordinator import SpecCoordinator
from inferengine.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from inferengine.executor.base import StepHandle

logger = init_logger(__name__)

GRAMMAR_WAIT_S = 0.01  # an idle engine waits this long at a time for a grammar being built


class EngineCore:
    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        self.config = config
        self.executor = make_executor(config)
        try:
            num_blocks = self.executor.determine_num_blocks()
            check_capacity(config, num_blocks)
            config.cache_config.num_blocks = num_blocks
            num_host_blocks, self.kv_page_bytes = host_tier_size(config, self.executor)
            config.cache_config.num_host_blocks = num_host_blocks
            self.executor.initialize_cache(num_blocks, num_host_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        pp = config.parallel_config.pipeline_parallel_size
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            pipeline_stages=pp,
            keep_finished=config.speculative_config is not None,
            kv_page_bytes=self.kv_page_bytes,
            kv_transfer_config=config.kv_transfer_config,
        )
        self._pending_errors: dict[str, str] = {}
        self._pending_outputs: list[EngineCoreOutput] = []
        # Steps launched and not yet collected, oldest first, each with whether it speculated.
        # Async scheduling keeps one step running while the next is prepared; pipeline
        # parallelism keeps one per stage, over disjoint requests, so the stages overlap.
        self._inflight: deque[tuple[SchedulerOutput, StepHandle, bool]] = deque()
        # The newest step launched before its grammar masks could be made (they need the
        # tokens of the steps before it), until they are given.
        self._masks_owed: tuple[SchedulerOutput, StepHandle] | None = None
        self._pipelined = pp > 1
        self.depth = pp if pp > 1 else (2 if config.scheduler_config.async_scheduling else 1)
        self.structured = StructuredOutputManager(
            config.model_config.tokenizer, config.model_config.vocab_size
        )
        # Whether steps speculate, and their drafts (inert without a speculative config).
        self.spec = SpecCoordinator(
            config.speculative_config, self.scheduler, self.executor.propose_drafts
        )
        interval = envs.step_stats_interval_s()
        self.step_timer = StepTimer(interval) if interval > 0 else None
        logger.info("engine core ready in %.2f s", time.perf_counter() - start)

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one the engine cannot serve is finished at once with an error."""
        error = self._validate(request)
        if error is not None:
            self._pending_errors[request.request_id] = error
            self._pending_outputs.append(
                EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)
            )
            return
        core_request = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time or None,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=request.lora_request,
            cache_key=request.cache_key,
            cache_ttl_s=request.cache_ttl_s,
            cache_breakpoints=[tuple(b) for b in request.cache_breakpoints],
            kv_transfer_params=request.kv_transfer_params,
            pooling_params=request.pooling_params,
        )
        if request.sampling_params.structured_outputs is not None:
            self.structured.submit(core_request)  # joins the scheduler once its matcher is built
        else:
            self.scheduler.add_request(core_request)

    def _validate(self, request: EngineCoreRequest) -> str | None:
        n = len(request.prompt_token_ids)
        max_len = self.config.scheduler_config.max_model_len
        vocab = self.config.model_config.vocab_size
        if n == 0:
            return "the prompt is empty; send at least one token."
        if request.lora_request is not None and self.config.lora_config is None:
            return "a LoRA adapter was asked for; this engine was started without --enable-lora."
        if n > max_len:
            return f"the prompt has {n} tokens, more than max_model_len ({max_len})."
        if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab:
            return f"the prompt has token ids outside the vocabulary [0, {vocab})."
        if request.request_id in self.scheduler.requests or request.request_id in self.structured:
            return f"request id {request.request_id!r} is already in use."
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for req_id in request_ids:
            self.structured.finish(req_id)
        self.spec.requests_finished()

    # ---- the loop ----------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending_outputs)
            or bool(self._inflight)
            or bool(self.structured.waiting)
        )

    def step(self) -> EngineCoreOutputs:
        """One step: launch a step if there is room for one, and collect the oldest when the
        steps in flight reach the depth (or nothing new could run). With async scheduling the
        host prepares step N+1 while the GPU computes step N; the outputs are step N's.

        A step that verifies drafts is collected before the next is scheduled; a speculating
        step is launched behind one in flight only when it may be drafted ahead (the
        speculation room, `spec_decode/coordinator.py`, says why). Otherwise the first
        speculating step after others only collects the oldest step in flight, which drafts.
        A grammar's mask for a token needs the token before it: with a step in flight, the new
        step's sampling waits for masks made after that step is collected, while its forward
        runs; the step after it is launched once they are given."""
        self._admit_grammars()
        speculate = self.spec.speculates()
        if (speculate and self._inflight) or self._drafts_in_flight():
            # Drafting ahead needs the one step in flight to verify no drafts (each of its
            # requests gains exactly one token: the next step's positions are known).
            ahead = len(self._inflight) == 1 and not self._drafts_in_flight()
            if speculate and ahead and self._may_draft_ahead():
                self.spec.draft_ahead()
                self._launch(self.depth, speculate)
            outputs = self._collect()
            self._provide_owed_masks()
            if not self._inflight and self.spec.speculates() and not self.structured.matchers:
                # Drafted for the next step on collecting this one: launch it before these
                # outputs go out, so that sending them overlaps the forward.
                self._launch(self._depth(True), True)
            return self._finish_step(outputs)
        depth = self._depth(speculate)
        launched_work = self._launch(depth, speculate)
        if self._inflight and (
            len(self._inflight) >= depth or not launched_work or self._drafts_in_flight()
        ):
            outputs = self._collect()
        else:
            outputs = EngineCoreOutputs(
                scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()
            )
        if self._provide_owed_masks() and not self.spec.speculates():
            # The masked sampling is queued: queue the next forward behind it now, not after
            # this step's outputs are sent, or the GPU waits for the host every step. (Drafts
            # need every step collected, so not when speculation starts next.)
            self._launch(depth, speculate)
        return self._finish_step(outputs)

    def _launch(self, depth: int, speculate: bool) -> bool:
        """Schedule and launch a step if fewer than `depth` are in flight; whether it has work."""
        if len(self._inflight) >= depth or not self.scheduler.has_unfinished_requests():
            return False
        timer = self.step_timer
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule(depth)
        self.spec.step_scheduled(scheduler_output, ahead=bool(self._inflight))
        if self.structured.matchers:
            # Pipelined steps never hold a request whose token is on its way.
            if depth > 1 and not self._pipelined:
                scheduler_output.grammar_deferred = True
            else:
                self._attach_grammar(scheduler_output)
        t1 = time.perf_counter()
        pending = self.executor.execute_model_async(scheduler_output)
        if scheduler_output.grammar_deferred:
            self._masks_owed = (scheduler_output, pending)
        self._inflight.append((scheduler_output, pending, speculate))
        if timer is not None:
            timer.launched(scheduler_output, pending, t1 - t0, time.perf_counter() - t1)
        return scheduler_output.total_num_scheduled_tokens > 0

    def _provide_owed_masks(self) -> bool:
        """Give the step launched without its grammar masks those masks, once every step
        before it is collected (its masks need their tokens); whether it did."""
        owed = self._masks_owed
        if owed is None or not self._inflight or self._inflight[0][1] is not owed[1]:
            return False
        self._masks_owed = None
        so, handle = owed
        self._attach_grammar(so)
        handle.provide_grammar(so.grammar_req_ids, so.grammar_bitmask)
        return True

    def _attach_grammar(self, so: SchedulerOutput) -> None:
        rows, mask = self.structured.bitmask(
            list(so.num_scheduled_tokens), self.scheduler.requests, so.scheduled_spec_decode_tokens
        )
        so.grammar_req_ids, so.grammar_bitmask = rows, mask

    def _depth(self, speculate: bool) -> int:
        """Steps that may be in flight: one for a speculating step that cannot draft ahead."""
        return self.depth if not speculate or self._may_draft_ahead() else 1

    def _may_draft_ahead(self) -> bool:
        """Whether a speculating step may be launched before the one in flight is collected:
        two steps overlap, and nothing needs every token first (grammars, pipeline stages)."""
        overlap = self.depth == 2 and not self._pipelined and not self.structured.matchers
        return self.spec.may_draft_ahead(overlap)

    def _drafts_in_flight(self) -> bool:
        """Whether the newest step in flight verifies drafts."""
        return bool(self._inflight) and bool(self._inflight[-1][0].scheduled_spec_decode_tokens)

    def _collect(self) -> EngineCoreOutputs:
        """Wait for the oldest step in flight, fold in its tokens, and draft for the next step."""
        scheduler_output, pending, speculated = self._inflight.popleft()
        t0 = time.perf_counter()
        runner_output = pending.resolve()
        t1 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.structured.matchers:
            self.structured.advance(outputs, self.scheduler)
        self.spec.step_collected(speculated, scheduler_output, runner_output, pending.graph_size)
        if self.step_timer is not None:
            self.step_timer.resolved(t1 - t0, time.perf_counter() - t1)
        return outputs

    def _admit_grammars(self) -> None:
        if not self.structured.waiting:
            return
        if not self.scheduler.has_unfinished_requests() and not self._inflight:
            self.structured.wait(GRAMMAR_WAIT_S)  # nothing else to run: let the grammar build
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        for req_id, error in failed.items():
            self._pending_errors[req_id] = error
            self._pending_outputs.append(
                EngineCoreOutput(req_id, [], finish_reason=FinishReason.ABORT)
            )

    def _finish_step(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        if self._pending_outputs:
            outputs.outputs.extend(self._pending_outputs)
            outputs.errors = self._pending_errors
            self._pending_outputs, self._pending_errors = [], {}
        return outputs

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def expert_token_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, by layer (empty for a dense model)."""
        return self.executor.expert_token_counts()

    def check_health(self) -> None:
        """Raise `EngineDeadError` if a worker process is gone (polled while idle)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
