"""The speculation room on its own (a real scheduler, no model): which requests get drafts and
how many, lookahead pages a draft model drafts into, drafts dropped when speculation stops,
ended requests handed on, and an engine without a speculative config never speculating."""

from __future__ import annotations

import pytest

from inferengine.config import SpeculativeConfig
from inferengine.core.request import RequestStatus
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from inferengine.sampling_params import SamplingParams
from inferengine.spec_decode.base import may_speculate
from inferengine.spec_decode.coordinator import SpecCoordinator
from inferengine.spec_decode.draft_policy import DraftLengthPolicy
from tests.core.helpers import make_request, make_scheduler, step

NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3)
DRAFT_MODEL = SpeculativeConfig("draft_model", 3, model="/the/draft")


@pytest.fixture
def always_speculate(monkeypatch):
    """The policy speculates and keeps every draft (it decides from measured times otherwise)."""
    monkeypatch.setattr(DraftLengthPolicy, "speculate_now", lambda self, n: True)
    monkeypatch.setattr(
        DraftLengthPolicy,
        "num_drafts",
        lambda self, request_id, available, batch_tokens, padded=False: available,
    )


def _nothing() -> SchedulerOutput:
    return SchedulerOutput([], [], {}, 0)


def _no_worker(wanted):
    raise AssertionError(f"asked the worker for drafts: {wanted}")


def _collected(coordinator, sched, token=4, speculated=True):
    """One step through the scheduler (every request samples `token`), told to the room."""
    out, _ = step(sched, token)
    ids = list(out.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(ids, [[token] for _ in ids])
    coordinator.step_collected(speculated, out, runner_output, None)
    return out


@pytest.mark.parametrize(
    ("params", "num_output_tokens", "allowed"),
    [
        (SamplingParams(temperature=0), 0, True),
        (SamplingParams(temperature=1.0), 0, True),
        (SamplingParams(temperature=0, seed=3), 0, True),  # greedy: the seed draws nothing
        (SamplingParams(temperature=1.0, seed=3), 0, False),
        (SamplingParams(temperature=0, logprobs=0), 0, False),
        (SamplingParams(temperature=0, presence_penalty=0.5), 0, False),
        (SamplingParams(temperature=0, repetition_penalty=1.2), 0, False),
        (SamplingParams(temperature=0, min_tokens=5), 4, False),
        (SamplingParams(temperature=0, min_tokens=5), 5, True),
    ],
)
def test_which_requests_may_speculate(params, num_output_tokens, allowed):
    assert may_speculate(params, num_output_tokens) is allowed


def test_without_a_speculative_config_nothing_speculates_or_drafts():
    sched = make_scheduler()
    coordinator = SpecCoordinator(None, sched, _no_worker)
    sched.add_request(make_request("a", [1, 2, 3, 1, 2, 3], temperature=0))
    assert coordinator.speculates() is False
    assert coordinator.proposer is None and coordinator.policy is None
    assert coordinator.may_draft_ahead(True) is False
    _collected(coordinator, sched)
    coordinator.requests_finished()
    assert coordinator.speculates() is False
    assert sched.requests["a"].spec_token_ids == []


def test_a_token_proposer_drafts_only_for_requests_that_may_speculate(always_speculate):
    sched = make_scheduler()
    coordinator = SpecCoordinator(NGRAM, sched, _no_worker)
    assert coordinator.speculates() is False  # nothing to run yet
    prompt = [1, 2, 3, 4, 1, 2, 3]  # with the sampled 4, the tail 2 3 4 ran on with 1 2 3
    kinds = {
        "greedy": {"temperature": 0},
        "sampled": {"temperature": 1.0},
        "seeded": {"temperature": 1.0, "seed": 5},
        "logprobs": {"temperature": 0, "logprobs": 1},
        "penalty": {"temperature": 0, "frequency_penalty": 0.5},
        "min_tokens": {"temperature": 0, "min_tokens": 3},
        "two_left": {"temperature": 0, "max_tokens": 3},  # room for one draft only
    }
    for name, params in kinds.items():
        sched.add_request(make_request(name, prompt, **{"max_tokens": 20, **params}))
    assert coordinator.speculates() is True  # the first step speculates
    _collected(coordinator, sched)
    drafts = {name: sched.requests[name].spec_token_ids for name in kinds}
    assert drafts == {
        "greedy": [1, 2, 3],
        "sampled": [1, 2, 3],
        "seeded": [],
        "logprobs": [],
        "penalty": [],
        "min_tokens": [],
        "two_left": [1],
    }
    assert coordinator.speculates() is True
    # The drafts go out with the next step, which verifies them.
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"greedy": [1, 2, 3], "sampled": [1, 2, 3],
                                                "two_left": [1]}  # fmt: skip
    assert out.num_scheduled_tokens["greedy"] == 4 and out.num_scheduled_tokens["seeded"] == 1


def test_drafts_stay_within_the_budget_a_step_has_logits_rows_for(always_speculate, monkeypatch):
    import inferengine.spec_decode.coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "MAX_DRAFTS_PER_STEP", 4)
    sched = make_scheduler()
    coordinator = SpecCoordinator(NGRAM, sched, _no_worker)
    for name in "abc":
        sched.add_request(make_request(name, [1, 2, 3, 4, 1, 2, 3], temperature=0))
    _collected(coordinator, sched)
    assert [sched.requests[n].spec_token_ids for n in "abc"] == [[1, 2, 3], [1], []]


def test_a_draft_model_drafts_on_lookahead_pages_the_scheduler_allocates(always_speculate):
    sched = make_scheduler(num_blocks=10, block_size=8)
    asked = []

    def worker(wanted):
        asked.append(wanted)
        return {req_id: [50 + i for i in range(k)] for req_id, (k, _) in wanted.items()}

    coordinator = SpecCoordinator(DRAFT_MODEL, sched, worker)
    assert coordinator.may_draft_ahead(True) is False  # it drafts from every token
    request = make_request("a", list(range(10, 24)), max_tokens=20, temperature=0)
    sched.add_request(request)
    _collected(coordinator, sched)
    # 14 computed, the sampled token and 3 drafts: 18 positions, a third page of 8.
    assert asked == [{"a": (3, [3])}]
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2, 3]
    assert request.spec_token_ids == [50, 51, 52]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_cached_reqs[0].new_block_ids == []  # the worker has the page already


def test_a_draft_model_gets_no_drafts_where_no_page_is_free(always_speculate):
    sched = make_scheduler(num_blocks=3, block_size=8)  # two usable pages
    coordinator = SpecCoordinator(DRAFT_MODEL, sched, _no_worker)
    request = make_request("a", list(range(10, 24)), max_tokens=20, temperature=0)
    sched.add_request(request)
    _collected(coordinator, sched)
    assert request.spec_token_ids == [] and request.status == RequestStatus.RUNNING
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2]


def test_drafts_not_yet_scheduled_are_dropped_when_speculation_stops(always_speculate, monkeypatch):
    sched = make_scheduler()
    coordinator = SpecCoordinator(NGRAM, sched, _no_worker)
    sched.add_request(make_request("a", [1, 2, 3, 4, 1, 2, 3], max_tokens=20, temperature=0))
    _collected(coordinator, sched)
    assert sched.requests["a"].spec_token_ids == [1, 2, 3]
    monkeypatch.setattr(DraftLengthPolicy, "speculate_now", lambda self, n: False)
    coordinator.step_collected(False, _nothing(), ModelRunnerOutput([], []), None)
    assert sched.requests["a"].spec_token_ids == []
    assert coordinator.speculates() is False


def test_steps_drafted_ahead_are_those_with_drafts_scheduled_behind_another():
    coordinator = SpecCoordinator(NGRAM, make_scheduler(), _no_worker)
    drafts = _nothing()
    drafts.scheduled_spec_decode_tokens = {"a": [1, 2]}
    coordinator.step_scheduled(drafts, ahead=False)
    coordinator.step_scheduled(_nothing(), ahead=True)
    assert coordinator.num_steps_drafted_ahead == 0
    coordinator.step_scheduled(drafts, ahead=True)
    assert coordinator.num_steps_drafted_ahead == 1


def test_ended_requests_reach_the_policy_and_the_proposer(monkeypatch):
    from inferengine.config import CacheConfig, SchedulerConfig
    from inferengine.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=64), keep_finished=True)
    coordinator = SpecCoordinator(NGRAM, sched, _no_worker)
    told, forgotten = [], []
    monkeypatch.setattr(
        coordinator.proposer, "finish", lambda *args: told.append((args[0], list(args[1]), args[2]))
    )
    monkeypatch.setattr(coordinator.policy, "finish", forgotten.append)
    sched.add_request(make_request("a", [5, 6, 7], temperature=0))
    step(sched, 9)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    coordinator.requests_finished()
    assert told == [("a", [5, 6, 7, 9], 3)] and forgotten == ["a"]
    assert sched.just_finished == []
