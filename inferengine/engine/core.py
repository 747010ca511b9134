"""`EngineCore`: the step loop: schedule, execute, update. Token ids in, token ids out.

Runs in-process (for `LLM` and tests) or in its own process behind `core_client` (the server).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from inferengine import envs
from inferengine.config import MAX_DRAFTS_PER_STEP, EngineConfig
from inferengine.core.engine_io import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from inferengine.core.request import FinishReason, Request, RequestStatus
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from inferengine.core.scheduler import Scheduler
from inferengine.engine.kv_sizing import check_capacity, host_tier_size
from inferengine.engine.step_timer import StepTimer
from inferengine.executor.base import make_executor
from inferengine.logger import init_logger
from inferengine.spec_decode import make_token_proposer
from inferengine.spec_decode.draft_policy import DraftLengthPolicy
from inferengine.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from inferengine.executor.base import StepHandle

logger = init_logger(__name__)

POLICY_LOG_INTERVAL_S = 10.0  # how often a speculating engine logs its draft policy
# While not speculating, every PROBE_EVERY steps the token proposer is asked about up to
# PROBE_REQUESTS running requests, so that a batch with nothing to draft (random prompts) does
# not even try speculating, and one that starts quoting its input does.
PROBE_EVERY = 16
PROBE_REQUESTS = 8
GRAMMAR_WAIT_S = 0.01  # an idle engine waits this long at a time for a grammar being built
MIN_DRAFT_SHARE = 0.02  # below this share of requests with drafts, speculating cannot pay
DRAFT_SHARE_WINDOW = 16  # requests looked at that replace the running share entirely


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
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config)
        self.scheduler.keep_finished = config.speculative_config is not None
        self.scheduler.kv_page_bytes = self.kv_page_bytes
        self._pending_errors: dict[str, str] = {}
        self._pending_outputs: list[EngineCoreOutput] = []
        # Steps launched and not yet collected, oldest first, each with whether it speculated.
        # Async scheduling keeps one step running while the next is prepared; pipeline
        # parallelism keeps one per stage, over disjoint requests, so the stages overlap.
        self._inflight: deque[tuple[SchedulerOutput, StepHandle, bool]] = deque()
        # The newest step launched before its grammar masks could be made (they need the
        # tokens of the steps before it), until they are given.
        self._masks_owed: tuple[SchedulerOutput, StepHandle] | None = None
        pp = config.parallel_config.pipeline_parallel_size
        self.scheduler.pipelined = pp > 1
        self.depth = pp if pp > 1 else (2 if config.scheduler_config.async_scheduling else 1)
        self.spec = config.speculative_config
        self.proposer = make_token_proposer(self.spec)
        self.draft_policy = (
            DraftLengthPolicy(self.spec.num_speculative_tokens) if self.spec is not None else None
        )
        # The first step speculates; from then on the draft policy decides as steps complete.
        self._speculate_next = self.spec is not None
        self.structured = StructuredOutputManager(
            config.model_config.tokenizer, config.model_config.vocab_size
        )
        self._draft_share = 1.0  # running share of requests the proposer drafted for
        self._padded_verify_tokens = 0  # the padded shape of the last verify step collected
        self._drafted: list[Request] = []  # requests given drafts since they were last dropped
        self._drafts_ready = False  # drafts proposed for the next step, not yet scheduled
        # Steps with drafts launched before the step in flight was collected (drafting ahead).
        self.num_steps_drafted_ahead = 0
        self._probe_step = 0
        self._last_completion = self._last_policy_log = time.perf_counter()
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
            cache_key=request.cache_key,
            cache_ttl_s=request.cache_ttl_s,
            cache_breakpoints=[tuple(b) for b in request.cache_breakpoints],
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
        if self.spec is not None:
            self._forget_finished()

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

        Drafts continue a request's tokens, so a step that verifies drafts is collected before
        the next is scheduled (the count it accepts moves every later position). A step that
        verifies none gains one token per request; while it runs, the next step is drafted
        past a guess for that token (a token proposer's continuation of the known text) and
        launched behind it, so speculating costs no exposed host time where nothing is drafted.
        Otherwise the first speculating step after others only collects the oldest step in
        flight and drafts. A grammar's mask for a token needs the token before it: with a step
        in flight, the new step's sampling waits for masks made after that step is collected,
        while its forward runs; the step after it is launched once they are given."""
        self._admit_grammars()
        speculate = self._speculate_now()
        if (speculate and self._inflight) or self._drafts_in_flight():
            if speculate and self._can_draft_ahead():
                # Collecting the step before drafted already, unless the policy had not yet
                # seen a step complete (the first step after start-up).
                if not self._drafts_ready and self._policy_speculates():
                    self._propose_drafts()
                self._launch(self.depth, speculate)
                if self._drafts_in_flight():
                    self.num_steps_drafted_ahead += 1
            outputs = self._collect(speculate)
            self._provide_owed_masks()
            if not self._inflight and self._speculate_now() and not self.structured.matchers:
                # Drafted for the next step on collecting this one: launch it before these
                # outputs go out, so that sending them overlaps the forward.
                self._launch(self._depth(True), True)
            return self._finish_step(outputs)
        depth = self._depth(speculate)
        launched_work = self._launch(depth, speculate)
        if self._inflight and (
            len(self._inflight) >= depth or not launched_work or self._drafts_in_flight()
        ):
            outputs = self._collect(speculate)
        else:
            outputs = EngineCoreOutputs(
                scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()
            )
        if self._provide_owed_masks() and not self._speculate_now():
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
        self.scheduler.pipeline_depth = depth if self.scheduler.pipelined else 1
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self._drafts_ready = False
        if self.structured.matchers:
            # Pipelined steps never hold a request whose token is on its way.
            if depth > 1 and not self.scheduler.pipelined:
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
        """Whether a speculating step may be drafted and launched before the one in flight is
        collected: drafts come from a token proposer and nothing needs every token first
        (grammars, pipeline stages, synchronous steps)."""
        return (
            self.depth == 2
            and not self.scheduler.pipelined
            and self.proposer is not None
            and not self.structured.matchers
        )

    def _can_draft_ahead(self) -> bool:
        """`_may_draft_ahead`, and the one step in flight verifies no drafts (so each of its
        requests gains exactly one token, and the next step's positions are known)."""
        return self._may_draft_ahead() and len(self._inflight) == 1 and not self._drafts_in_flight()

    def _drafts_in_flight(self) -> bool:
        """Whether the newest step in flight verifies drafts."""
        return bool(self._inflight) and bool(self._inflight[-1][0].scheduled_spec_decode_tokens)

    def _policy_speculates(self) -> bool:
        assert self.draft_policy is not None
        return self.draft_policy.speculate_now(len(self.scheduler.running))

    def _speculate_now(self) -> bool:
        return self._speculate_next and self.scheduler.has_unfinished_requests()

    def _collect(self, speculate: bool) -> EngineCoreOutputs:
        """Wait for the oldest step in flight, fold in its tokens, and draft for the next step."""
        scheduler_output, pending, speculated = self._inflight.popleft()
        t0 = time.perf_counter()
        runner_output = pending.resolve()
        t1 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if scheduler_output.scheduled_spec_decode_tokens:
            self._padded_verify_tokens = pending.graph_size or 0
        if self.structured.matchers:
            self._advance_grammars(outputs)
        if self.spec is not None:
            self._forget_finished()
            self._plan_speculation(speculated, scheduler_output, runner_output)
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

    def _advance_grammars(self, outputs: EngineCoreOutputs) -> None:
        """Feed the sampled tokens to the matchers. A complete grammar allows only the end of
        text, so its request stops there like any other (the same tokens with and without
        speculation); one that cannot stop on EOS (`ignore_eos`) is ended by the grammar. A
        grammar that refused a token (only if masks and tokens went apart) ends its request
        with an error."""
        for out in outputs.outputs:
            took, complete = self.structured.accept(out.request_id, out.new_token_ids)
            request = self.scheduler.requests.get(out.request_id)
            stops_itself = (
                request is not None
                and request.eos_token_id is not None
                and not request.sampling_params.ignore_eos
            )
            if out.finish_reason is None and complete and not (took and stops_itself):
                status = RequestStatus.FINISHED_STOPPED if took else RequestStatus.FINISHED_ABORTED
                (request,) = self.scheduler.finish_requests([out.request_id], status) or [None]
                if request is not None:
                    out.finish_reason = request.finish_reason
                if not took:
                    outputs.errors = {
                        **outputs.errors,
                        out.request_id: "the grammar refused a token",
                    }
            if out.finish_reason is not None:
                self.structured.finish(out.request_id)

    def _finish_step(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        if self._pending_outputs:
            outputs.outputs.extend(self._pending_outputs)
            outputs.errors = self._pending_errors
            self._pending_outputs, self._pending_errors = [], {}
        return outputs

    def _forget_finished(self) -> None:
        """Requests that ended: the policy forgets them; the suffix proposer keeps their text
        for later requests."""
        assert self.draft_policy is not None
        for request in self.scheduler.just_finished:
            self.draft_policy.finish(request.request_id)
            if self.proposer is not None:
                self.proposer.finish(
                    request.request_id, request.all_token_ids, request.num_prompt_tokens
                )
        self.scheduler.just_finished.clear()

    def _plan_speculation(
        self, speculated: bool, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> None:
        """Feed the draft policy what the step just collected cost and yielded; if the next
        step should speculate, draft for it."""
        policy = self.draft_policy
        assert policy is not None
        now = time.perf_counter()
        seconds, self._last_completion = now - self._last_completion, now
        for req_id, num_drafts, num_accepted in self.scheduler.last_verified:
            policy.record_acceptance(req_id, num_drafts, num_accepted)
        so = scheduler_output
        num_drafts = sum(len(d) for d in so.scheduled_spec_decode_tokens.values())
        # Only decode steps are measured: a prompt chunk's cost says nothing about speculating.
        decode_only = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) + num_drafts
        policy.record_step(
            speculated,
            len(so.num_scheduled_tokens) if decode_only else 0,
            so.total_num_scheduled_tokens,
            sum(len(t) for t in runner_output.sampled_token_ids),
            seconds,
        )
        num_decoding = len(self.scheduler.running)
        if not speculated and self.proposer is not None:
            self._probe_proposer()
        self._speculate_next = policy.speculate_now(num_decoding) and (
            self._draft_share >= MIN_DRAFT_SHARE
        )
        if now - self._last_policy_log >= POLICY_LOG_INTERVAL_S:
            self._last_policy_log = now
            stats = self.scheduler.spec_stats
            logger.info(
                "speculation: %d drafts, %d draft tokens, %d accepted, %d drafted ahead; %s",
                stats.num_drafts,
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
                self.num_steps_drafted_ahead,
                policy.summary(),
            )
        if self._speculate_next:
            self._propose_drafts()
        else:
            self._drop_drafts()

    def _count_drafts(self, looked: int, drafted: int) -> None:
        """Fold `drafted` of `looked` requests into the running share that got drafts."""
        if looked:
            weight = min(1.0, looked / DRAFT_SHARE_WINDOW)
            self._draft_share += weight * (drafted / looked - self._draft_share)

    def _probe_proposer(self) -> None:
        """Ask the token proposer about a few running requests (their last token may still be
        on its way: a probe, not drafts to verify)."""
        assert self.proposer is not None and self.spec is not None
        self._probe_step += 1
        if self._probe_step % PROBE_EVERY:
            return
        running, start = self.scheduler.running, self._probe_step // PROBE_EVERY * PROBE_REQUESTS
        n = min(PROBE_REQUESTS, len(running))
        picked = [running[(start + i) % len(running)] for i in range(n)]
        drafted = sum(1 for r in picked if self.proposer.probe(r.all_token_ids, r.request_id))
        self._count_drafts(len(picked), drafted)

    def _propose_drafts(self) -> None:
        """Draft tokens for each running request that decodes next and may speculate.

        Left out (they decode one token at a time): seeded sampled requests, whose draws must
        stay those of plain decoding; penalties and pending min_tokens, which depend on every
        earlier token; and logprobs, which are reported per sampled token. A draft model runs
        in the worker, on lookahead pages allocated here for its drafts and their verification.
        A request whose next token is still being sampled (drafting ahead, token proposers
        only) gets the drafts that follow the proposer's guess for that token."""
        assert self.spec is not None and self.draft_policy is not None
        self._drop_drafts()
        k = self.spec.num_speculative_tokens
        batch_tokens = len(self.scheduler.running)
        padded = batch_tokens * (1 + k) <= self._padded_verify_tokens  # drafts cost nothing
        max_len = self.config.scheduler_config.max_model_len
        budget = MAX_DRAFTS_PER_STEP  # logits rows start-up reserved memory for
        wanted: dict[str, tuple[int, list[int]]] = {}
        kv = self.scheduler.kv_cache_manager
        looked = drafted = 0
        for request in self.scheduler.running:
            p = request.sampling_params
            on_way = request.num_output_placeholders
            if (
                request.num_computed_tokens != request.num_tokens - 1 + on_way
                or on_way > (1 if self.proposer is not None else 0)
                or (p.seed is not None and not p.greedy)
                or p.logprobs is not None
                or p.uses_penalties
                or request.num_output_tokens + on_way < p.min_tokens
            ):
                continue
            cap = min(
                k,
                budget,
                request.max_tokens - request.num_output_tokens - on_way - 1,
                max_len - request.num_tokens - on_way - 1,
            )
            if cap > 0:
                cap = self.draft_policy.num_drafts(request.request_id, cap, batch_tokens, padded)
            if cap <= 0:
                continue
            batch_tokens += cap
            budget -= cap
            if self.proposer is not None:
                request.spec_token_ids = self.proposer.propose(
                    request.all_token_ids, cap, request.request_id, lookahead=on_way
                )
                looked += 1
                if request.spec_token_ids:
                    drafted += 1
                    self._drafted.append(request)
                continue
            new_blocks = kv.allocate_slots(request, 1 + cap)
            if new_blocks is not None:  # no free page: no drafts, never a preemption
                wanted[request.request_id] = (cap, [b.block_id for b in new_blocks])
        self._count_drafts(looked, drafted)
        self._drafts_ready = True
        if wanted:
            for req_id, drafts in self.executor.propose_drafts(wanted).items():
                request = self.scheduler.requests[req_id]
                request.spec_token_ids = drafts
                self._drafted.append(request)

    def _drop_drafts(self) -> None:
        """Forget drafts not yet scheduled (a step that no longer speculates, or drafts made
        for a step that was not launched): only the newest proposals are ever scheduled."""
        for request in self._drafted:
            request.spec_token_ids = []
        self._drafted.clear()
        self._drafts_ready = False

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
