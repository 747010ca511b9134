"""Random add / step / abort sequences against a small pool, checking invariants after every op."""

from __future__ import annotations

import itertools
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from inferengine.core.request import RequestStatus
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tests.core.helpers import EOS, check_pool, make_request, make_scheduler

BS = 8
# Prompts start with a prefix of one of these, so requests share cached blocks.
BASES = [[3 + (i * 7 + j * 5) % 11 for j in range(64)] for i in range(3)]


class SchedulerMachine(RuleBasedStateMachine):
    """A scheduler plus a fake worker that mirrors block tables and writes token ids as KV."""

    policy = "fcfs"
    async_scheduling = False  # schedule step N+1 before step N's tokens come back

    @initialize(
        num_blocks=st.integers(5, 16),
        budget=st.sampled_from([6, 16, 40]),
        max_num_seqs=st.integers(1, 4),
        threshold=st.sampled_from([0, 5]),
    )
    def setup(self, num_blocks, budget, max_num_seqs, threshold):
        # Every request fits the pool alone, so the engine never has to fail one.
        self.max_model_len = min(48, (num_blocks - 1) * BS)
        self.sched = make_scheduler(
            num_blocks,
            BS,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=threshold,
            policy=self.policy,
        )
        self.kv = self.sched.kv_cache_manager
        self.ids = itertools.count()
        self.tables: dict[str, list[int]] = {}  # the fake worker's block tables
        self.content: dict[int, list[int | None]] = {b: [None] * BS for b in range(num_blocks)}
        self.added: list = []
        self.hash_tokens: dict[bytes, list[int]] = {}
        self.salt_of: dict[int, str | None] = {}  # the cache_salt of the request that wrote
        self.unknown_writes: list = []  # (block, offset, request, position) of tokens in flight
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    # ---- operations ----------------------------------------------------------------------

    @rule(
        base=st.integers(0, len(BASES) - 1),
        prefix_len=st.sampled_from([0, 8, 16, 20, 32]),
        suffix=st.lists(st.integers(3, 6), max_size=12),
        max_tokens=st.one_of(st.none(), st.integers(1, 24)),
        salt=st.sampled_from([None, None, "s"]),
        priority=st.one_of(st.none(), st.integers(0, 2)),
        ignore_eos=st.booleans(),
    )
    def add(self, base, prefix_len, suffix, max_tokens, salt, priority, ignore_eos):
        prompt = (BASES[base][:prefix_len] + suffix)[: self.max_model_len] or [3]
        n = next(self.ids)
        if priority is None:
            priority = -n  # more urgent than everything before it: preempts running requests
        request = make_request(
            f"r{n}",
            prompt,
            max_tokens,
            cache_salt=salt,
            priority=priority,
            arrival_time=float(n),
            ignore_eos=ignore_eos,
        )
        self.sched.add_request(request)
        self.added.append(request)

    @rule(seed=st.integers(0, 2**16), num_steps=st.integers(1, 8))
    def step(self, seed, num_steps):
        rng = random.Random(seed)
        for _ in range(num_steps):
            self.one_step(rng)

    @rule(pick=st.integers(0, 2**16), stop=st.booleans())
    def finish(self, pick, stop):
        live = sorted(self.sched.requests)
        if not live:
            return
        request = self.sched.requests[live[pick % len(live)]]
        status = RequestStatus.FINISHED_STOPPED if stop else RequestStatus.FINISHED_ABORTED
        assert self.sched.finish_requests([request.request_id], status) == [request]
        assert request.status == status and request.request_id not in self.kv.req_to_blocks

    def one_step(self, rng: random.Random) -> SchedulerOutput:
        sched = self.sched
        running_before = list(sched.running)
        computed_before = {r.request_id: r.num_computed_tokens for r in sched.requests.values()}
        pending_before = {r.request_id: r.num_output_placeholders for r in running_before}
        out = sched.schedule()
        # Budget, batch size and chunk limits.
        counts = out.num_scheduled_tokens
        assert (
            out.total_num_scheduled_tokens == sum(counts.values()) <= sched.max_num_batched_tokens
        )
        assert all(n >= 1 for n in counts.values())
        if sched.config.long_prefill_token_threshold:
            assert max(counts.values(), default=0) <= sched.config.long_prefill_token_threshold
        assert len(sched.running) <= sched.max_num_seqs
        assert set(counts) <= {r.request_id for r in sched.running}
        # Preemption: back to waiting with nothing computed, and no admission in that step.
        preempted = [r for r in running_before if r.status == RequestStatus.PREEMPTED]
        for request in preempted:
            assert request.num_computed_tokens == 0 and request in list(sched.waiting)
            assert request.request_id in out.finished_req_ids
        if preempted:
            assert out.scheduled_new_reqs == []
        self.apply_to_worker(out, computed_before)
        runner = self.fake_forward(out, pending_before, rng)
        if self.async_scheduling:
            self.in_flight, (out, runner) = (out, runner), self.in_flight or (None, None)
        if out is not None:
            sched.update_from_output(out, runner)
            self.resolve_writes()
        return self.in_flight[0] if self.async_scheduling else out

    def resolve_writes(self) -> None:
        """Tokens sampled by the step just collected are the inputs of the one in flight."""
        for block_id, offset, request, pos in self.unknown_writes:
            self.content[block_id][offset] = request.all_token_ids[pos]
        self.unknown_writes = []

    def apply_to_worker(self, out: SchedulerOutput, computed_before: dict[str, int]) -> None:
        """What the worker does with the output: update tables, then write K/V of every token."""
        for req_id in out.finished_req_ids:
            self.tables.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            request = self.sched.requests[new.req_id]
            assert new.prompt_token_ids + new.output_token_ids == request.all_token_ids
            self.tables[new.req_id] = list(new.block_ids)
        for cached in out.scheduled_cached_reqs:
            assert cached.num_computed_tokens == computed_before[cached.req_id]
            self.tables[cached.req_id].extend(cached.new_block_ids)
        assert set(self.tables) == {r.request_id for r in self.sched.running}
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.sched.requests[req_id]
            table = self.tables[req_id]
            assert table == self.kv.get_block_ids(req_id)
            start = request.num_computed_tokens - n
            for pos in range(start, start + n):
                block_id, offset = table[pos // BS], pos % BS
                self.salt_of[block_id] = request.cache_salt
                if pos < request.num_tokens:
                    self.content[block_id][offset] = request.all_token_ids[pos]
                else:  # async: the token is still being sampled by the step in flight
                    assert self.async_scheduling
                    self.content[block_id][offset] = None
                    self.unknown_writes.append((block_id, offset, request, pos))
        # Every computed token of every running request reads back what it wrote (or hit),
        # and only requests with the same cache_salt share K/V.
        for request in self.sched.running:
            table = self.tables[request.request_id]
            for pos in range(min(request.num_computed_tokens, request.num_tokens)):
                assert self.content[table[pos // BS]][pos % BS] == request.all_token_ids[pos]
                assert self.salt_of[table[pos // BS]] == request.cache_salt

    def fake_forward(
        self, out: SchedulerOutput, pending_before: dict[str, int], rng: random.Random
    ) -> ModelRunnerOutput:
        """A token for every request whose step reaches the end of its known tokens."""
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.sched.requests[req_id]
            samples = request.num_output_placeholders > pending_before.get(req_id, 0)
            assert samples == (
                request.num_computed_tokens >= request.num_tokens + pending_before.get(req_id, 0)
            )
            if not self.async_scheduling:
                assert samples == (request.num_computed_tokens == request.num_tokens)
            sampled.append([EOS if rng.random() < 0.1 else rng.randint(3, 6)] if samples else [])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def pages_are_consistent(self):
        sched, kv = self.sched, self.kv
        running = {r.request_id for r in sched.running}
        waiting = {r.request_id for r in sched.waiting}
        assert not running & waiting and set(sched.requests) == running | waiting
        assert set(kv.req_to_blocks) == running
        check_pool(kv.pool, {rid: kv.get_block_ids(rid) for rid in kv.req_to_blocks})
        for request in sched.running:
            assert request.status == RequestStatus.RUNNING
            blocks = kv.req_to_blocks[request.request_id]
            assert len(blocks) == -(-request.num_computed_tokens // BS)
            # Blocks past the computed full-block prefix are written to: never shared.
            for block in blocks[request.num_computed_tokens // BS :]:
                assert block.ref_cnt == 1
            for i, block in enumerate(blocks):
                assert block.block_hash is None or block.block_hash == request.block_hashes[i]
        # A cached block, in use or free, holds the K/V of the tokens its hash stands for.
        for request in self.added:
            for i, block_hash in enumerate(request.block_hashes):
                self.hash_tokens[block_hash] = request.all_token_ids[i * BS : (i + 1) * BS]
        for block_hash, block in kv.pool.cached.items():
            assert self.content[block.block_id] == self.hash_tokens[block_hash]
        for request in sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0
        # Between steps at most the step in flight still owes each request a token.
        for request in sched.requests.values():
            assert request.num_output_placeholders <= int(self.async_scheduling)
            assert request.num_output_tokens <= request.max_tokens

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        rng = random.Random(0)
        # Each step moves some request forward; even recomputing after preemptions, the work
        # left is bounded by a few passes over every live request.
        max_steps = 20 + 4 * self.max_model_len * len(self.sched.requests)
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            waiting_on_a_token = self.in_flight is not None
            out = self.one_step(rng)
            assert waiting_on_a_token or not out.is_empty, "nothing can be scheduled"
            self.pages_are_consistent()
        assert not self.sched.has_unfinished_requests(), "requests never finish"
        if self.in_flight is not None:  # a step launched before the last request finished
            self.sched.update_from_output(*self.in_flight)
            self.in_flight = None
        assert all(r.is_finished for r in self.added)
        for request in self.added:
            assert request.num_output_tokens <= request.max_tokens
            assert request.num_tokens <= max(self.max_model_len, request.num_prompt_tokens + 1)
        pool = self.kv.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
        check_pool(pool, {})


class PrioritySchedulerMachine(SchedulerMachine):
    policy = "priority"


class AsyncSchedulerMachine(SchedulerMachine):
    async_scheduling = True


class AsyncPrioritySchedulerMachine(SchedulerMachine):
    policy = "priority"
    async_scheduling = True


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
for machine in (
    SchedulerMachine,
    PrioritySchedulerMachine,
    AsyncSchedulerMachine,
    AsyncPrioritySchedulerMachine,
):
    machine.TestCase.settings = SETTINGS
test_fcfs_scheduler = SchedulerMachine.TestCase
test_priority_scheduler = PrioritySchedulerMachine.TestCase
test_async_fcfs_scheduler = AsyncSchedulerMachine.TestCase
test_async_priority_scheduler = AsyncPrioritySchedulerMachine.TestCase


request_args = st.fixed_dictionaries(
    {
        "base": st.integers(0, len(BASES) - 1),
        "prefix_len": st.sampled_from([0, 8, 16, 20]),
        "suffix": st.lists(st.integers(3, 6), max_size=12),
        "max_tokens": st.one_of(st.none(), st.integers(8, 30)),
        "salt": st.none(),
        "ignore_eos": st.just(True),
    }
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    num_blocks=st.integers(6, 12),
    budget=st.sampled_from([6, 16, 40]),
    old=st.lists(request_args, min_size=1, max_size=3),
    new=st.lists(request_args, min_size=1, max_size=3),
    warmup=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_urgent_requests_arriving_later_preempt_running_ones(
    num_blocks, budget, old, new, warmup, seed
):
    """Requests running in arrival order, then more urgent ones: victims already scheduled."""
    machine = PrioritySchedulerMachine()
    machine.setup(num_blocks=num_blocks, budget=budget, max_num_seqs=4, threshold=0)
    for args in old:
        machine.add(priority=2, **args)
    machine.step(seed, warmup)
    machine.pages_are_consistent()
    for args in new:
        machine.add(priority=0, **args)
    machine.teardown()
