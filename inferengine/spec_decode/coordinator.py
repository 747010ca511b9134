"""`SpecCoordinator`: speculation's room in the engine core: whether the next step speculates,
and the drafts it verifies.

The step loop asks it whether the next step speculates (`speculates`) and whether that step may
be drafted before the one in flight is collected (`may_draft_ahead`, then `draft_ahead`), and
tells it of each step scheduled (`step_scheduled`) and collected (`step_collected`) and of
requests that ended (`requests_finished`). Without a speculative config it never speculates and
does nothing.

Drafts continue a request's tokens, so the step loop collects a step that verifies drafts before
it schedules the next (the count accepted moves every later position). A step that verifies
none gains one token per request; while it runs, the next step may be drafted past a guess for
that token (a token proposer's continuation of the known text) and launched behind it.

On each collected step the draft policy (`draft_policy.py`) is fed what it cost and yielded and
decides whether the next step speculates; if so, drafts are made for it: by a token proposer here,
or by a draft model in the worker (`propose_in_worker`), on lookahead pages the scheduler
allocates. Which requests may speculate at all is `base.may_speculate`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from inferengine.config import MAX_DRAFTS_PER_STEP, SpeculativeConfig
from inferengine.logger import init_logger
from inferengine.spec_decode import make_token_proposer
from inferengine.spec_decode.base import may_speculate
from inferengine.spec_decode.draft_policy import DraftLengthPolicy

if TYPE_CHECKING:
    from inferengine.core.request import Request
    from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from inferengine.core.scheduler import Scheduler

logger = init_logger(__name__)

POLICY_LOG_INTERVAL_S = 10.0  # how often a speculating engine logs its draft policy
# While not speculating, every PROBE_EVERY steps the token proposer is asked about up to
# PROBE_REQUESTS running requests, so that a batch with nothing to draft (random prompts) does
# not even try speculating, and one that starts quoting its input does.
PROBE_EVERY = 16
PROBE_REQUESTS = 8
MIN_DRAFT_SHARE = 0.02  # below this share of requests with drafts, speculating cannot pay
DRAFT_SHARE_WINDOW = 16  # requests looked at that replace the running share entirely

# request id -> (number of drafts, lookahead page ids) in; request id -> drafts out
ProposeInWorker = Callable[[dict[str, tuple[int, list[int]]]], dict[str, list[int]]]


class SpecCoordinator:
    def __init__(
        self,
        config: SpeculativeConfig | None,
        scheduler: Scheduler,
        propose_in_worker: ProposeInWorker,
    ):
        self.config = config
        self.scheduler = scheduler
        self.propose_in_worker = propose_in_worker
        self.proposer = make_token_proposer(config)
        self.policy = (
            DraftLengthPolicy(config.num_speculative_tokens) if config is not None else None
        )
        # The first step speculates; from then on the draft policy decides as steps complete.
        self._speculate_next = config is not None
        self._draft_share = 1.0  # running share of requests the proposer drafted for
        self._padded_verify_tokens = 0  # the padded shape of the last verify step collected
        self._drafted: list[Request] = []  # requests given drafts since they were last dropped
        self._drafts_ready = False  # drafts proposed for the next step, not yet scheduled
        # Steps with drafts launched before the step in flight was collected (drafting ahead).
        self.num_steps_drafted_ahead = 0
        self._probe_step = 0
        self._last_completion = self._last_policy_log = time.perf_counter()

    # ---- what the step loop asks ----------------------------------------------------------

    def speculates(self) -> bool:
        """Whether the next step speculates."""
        return self._speculate_next and self.scheduler.has_unfinished_requests()

    def may_draft_ahead(self, steps_overlap: bool) -> bool:
        """Whether a speculating step may be drafted and launched before the one in flight is
        collected: the loop keeps two steps in flight and nothing needs every token first
        (`steps_overlap`: no grammars, no pipeline stages), and drafts come from a token
        proposer (a draft model drafts from every token)."""
        return steps_overlap and self.proposer is not None

    def draft_ahead(self) -> None:
        """Draft for a step about to launch behind the one in flight, if the policy speculates
        and collecting the step before did not draft already (as for the first step after
        start-up, which follows no collected step)."""
        assert self.policy is not None
        if not self._drafts_ready and self.policy.speculate_now(len(self.scheduler.running)):
            self._propose_drafts()

    # ---- what the step loop tells ---------------------------------------------------------

    def step_scheduled(self, so: SchedulerOutput, ahead: bool) -> None:
        """A step was scheduled (`ahead`: behind another in flight); the drafts are in it."""
        self._drafts_ready = False
        if ahead and so.scheduled_spec_decode_tokens:
            self.num_steps_drafted_ahead += 1

    def step_collected(
        self,
        speculated: bool,
        so: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        graph_size: int | None,
    ) -> None:
        """A step came back (`graph_size`: the padded shape it ran in, if any): learn from it
        and draft for the next step, or drop the drafts."""
        if self.config is None:
            return
        if so.scheduled_spec_decode_tokens:
            self._padded_verify_tokens = graph_size or 0
        self.requests_finished()
        self.plan(speculated, so, runner_output)

    def requests_finished(self) -> None:
        """Requests that ended: the policy forgets them; the suffix proposer keeps their text
        for later requests."""
        if self.config is None:
            return
        assert self.policy is not None
        for request in self.scheduler.just_finished:
            self.policy.finish(request.request_id)
            if self.proposer is not None:
                self.proposer.finish(
                    request.request_id, request.all_token_ids, request.num_prompt_tokens
                )
        self.scheduler.just_finished.clear()

    # ---- deciding ---------------------------------------------------------------------------

    def plan(
        self, speculated: bool, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> None:
        """Feed the draft policy what the step just collected cost and yielded; if the next
        step should speculate, draft for it."""
        policy = self.policy
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
        assert self.proposer is not None
        self._probe_step += 1
        if self._probe_step % PROBE_EVERY:
            return
        running, start = self.scheduler.running, self._probe_step // PROBE_EVERY * PROBE_REQUESTS
        n = min(PROBE_REQUESTS, len(running))
        picked = [running[(start + i) % len(running)] for i in range(n)]
        drafted = sum(1 for r in picked if self.proposer.probe(r.all_token_ids, r.request_id))
        self._count_drafts(len(picked), drafted)

    # ---- drafting ---------------------------------------------------------------------------

    def _draft_cap(self, request: Request, budget: int) -> int:
        """How many drafts `request` may take now (0: none): it decodes next, may speculate
        (`may_speculate`), and its drafts fit `max_tokens`, the context and `budget`. A request
        whose next token is still being sampled qualifies only for a token proposer (drafting
        ahead: the drafts follow the proposer's guess for that token)."""
        assert self.config is not None
        on_way = request.num_output_placeholders
        if (
            request.num_computed_tokens != request.num_tokens - 1 + on_way
            or on_way > (1 if self.proposer is not None else 0)
            or not may_speculate(request.sampling_params, request.num_output_tokens + on_way)
        ):
            return 0
        return min(
            self.config.num_speculative_tokens,
            budget,
            request.max_tokens - request.num_output_tokens - on_way - 1,
            self.scheduler.max_model_len - request.num_tokens - on_way - 1,
        )

    def _propose_drafts(self) -> None:
        """Draft tokens for each running request that decodes next and may speculate, as many
        as the draft policy keeps. A draft model runs in the worker, on lookahead pages the
        scheduler allocates for its drafts and their verification."""
        assert self.config is not None and self.policy is not None
        self._drop_drafts()
        k = self.config.num_speculative_tokens
        batch_tokens = len(self.scheduler.running)
        padded = batch_tokens * (1 + k) <= self._padded_verify_tokens  # drafts cost nothing
        budget = MAX_DRAFTS_PER_STEP  # logits rows start-up reserved memory for
        wanted: dict[str, tuple[int, list[int]]] = {}
        looked = drafted = 0
        for request in self.scheduler.running:
            cap = self._draft_cap(request, budget)
            if cap > 0:
                cap = self.policy.num_drafts(request.request_id, cap, batch_tokens, padded)
            if cap <= 0:
                continue
            batch_tokens += cap
            budget -= cap
            if self.proposer is not None:
                request.spec_token_ids = self.proposer.propose(
                    request.all_token_ids,
                    cap,
                    request.request_id,
                    lookahead=request.num_output_placeholders,
                )
                looked += 1
                if request.spec_token_ids:
                    drafted += 1
                    self._drafted.append(request)
                continue
            new_block_ids = self.scheduler.allocate_lookahead(request, cap)
            if new_block_ids is not None:  # no free page: no drafts
                wanted[request.request_id] = (cap, new_block_ids)
        self._count_drafts(looked, drafted)
        self._drafts_ready = True
        if wanted:
            for req_id, drafts in self.propose_in_worker(wanted).items():
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
