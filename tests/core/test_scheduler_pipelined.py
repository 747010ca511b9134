"""The scheduler under pipeline parallelism: steps in flight take disjoint requests, about
1/depth of them each, and a request scheduled again carries the tokens sampled meanwhile."""

from __future__ import annotations

from inferengine.core.sched_output import ModelRunnerOutput
from tests.core.helpers import make_request, make_scheduler


def _pipelined(depth: int, **kwargs):
    sched = make_scheduler(**kwargs)
    sched.pipelined, sched.pipeline_depth = True, depth
    return sched


def _sample(sched, out, token: int):
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[token] for _ in ids])
    return sched.update_from_output(out, runner)


def test_steps_in_flight_split_the_requests_and_skip_those_awaiting_a_token():
    sched = _pipelined(2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", list(range(10 * i + 1, 10 * i + 5))))
    a = sched.schedule()  # 4 waiting over 2 stages: 2 prompts
    b = sched.schedule()
    assert dict(a.num_scheduled_tokens) == {"r0": 4, "r1": 4}
    assert dict(b.num_scheduled_tokens) == {"r2": 4, "r3": 4}
    # Every request's token is on its way: nothing can run until a step comes back.
    assert sched.schedule().is_empty
    _sample(sched, a, 77)
    c = sched.schedule()
    assert dict(c.num_scheduled_tokens) == {"r0": 1, "r1": 1}
    assert [(d.req_id, d.new_token_ids) for d in c.scheduled_cached_reqs] == [
        ("r0", [77]),
        ("r1", [77]),
    ]
    _sample(sched, b, 88)
    _sample(sched, c, 78)
    d = sched.schedule()  # running order first; each new token is told once
    assert dict(d.num_scheduled_tokens) == {"r0": 1, "r1": 1}
    assert [x.new_token_ids for x in d.scheduled_cached_reqs] == [[78], [78]]
    e = sched.schedule()
    assert dict(e.num_scheduled_tokens) == {"r2": 1, "r3": 1}
    assert [x.new_token_ids for x in e.scheduled_cached_reqs] == [[88], [88]]


def test_a_prompt_chunk_that_samples_nothing_can_be_followed_at_once():
    sched = _pipelined(2, max_num_batched_tokens=8)
    sched.add_request(make_request("long", list(range(1, 21))))
    chunks = [dict(sched.schedule().num_scheduled_tokens) for _ in range(3)]
    # Chunks before the last sample nothing, so the next may go before they come back; the
    # last chunk samples, and nothing follows it until its token returns.
    assert chunks == [{"long": 8}, {"long": 8}, {"long": 4}]
    assert sched.schedule().is_empty


def test_without_pipelining_no_tokens_are_sent():
    sched = make_scheduler()
    sched.add_request(make_request("r", [1, 2, 3]))
    _sample(sched, sched.schedule(), 5)
    (cached,) = sched.schedule().scheduled_cached_reqs
    assert cached.new_token_ids == []


def test_the_stages_come_from_the_constructor_and_a_step_may_run_alone():
    """`pipeline_stages` sets the split; a step scheduled to run alone (a speculating one) takes
    every request, and without pipelining the steps in flight change nothing."""
    from inferengine.config import CacheConfig, SchedulerConfig
    from inferengine.core.scheduler import Scheduler

    for stages, depth, expected in ((2, None, 2), (2, 1, 4), (1, 2, 4)):
        sched = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=64), pipeline_stages=stages)
        assert (sched.pipelined, sched.pipeline_depth) == (stages > 1, stages)
        for i in range(4):
            sched.add_request(make_request(f"r{i}", [1, 2, 3]))
        assert len(sched.schedule(depth).num_scheduled_tokens) == expected
