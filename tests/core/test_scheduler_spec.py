"""Draft tokens in the scheduler: extra tokens in the one budget with lookahead pages, trimmed to
the budget, dropped before anyone is preempted, and rolled back by the rejected count."""

from __future__ import annotations

from helpers import make_request, make_scheduler, step

from inferengine.core.sched_output import ModelRunnerOutput


def _prefilled(sched, prompt_len=14, **kwargs):
    request = make_request("a", list(range(10, 10 + prompt_len)), max_tokens=50, **kwargs)
    sched.add_request(request)
    step(sched, 7)  # the prompt, and the first sampled token
    assert request.num_computed_tokens == prompt_len and request.num_tokens == prompt_len + 1
    return request


def test_drafts_are_scheduled_with_lookahead_pages_and_rolled_back():
    sched = make_scheduler(num_blocks=10, block_size=8)
    request = _prefilled(sched)
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2]
    request.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 5}  # the last token + 4 drafts
    assert out.scheduled_spec_decode_tokens == {"a": [5, 6, 7, 8]}
    # 14 computed + 5 = 19 positions: a third page for the drafts' KV.
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2, 3]
    assert request.num_computed_tokens == 19
    # Two drafts accepted, then one more token: 3 tokens, 2 drafts rejected.
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[5, 6, 9]]))
    assert request.output_token_ids == [7, 5, 6, 9]
    assert request.num_computed_tokens == 17 and request.num_tokens == 18
    assert request.spec_token_ids == []
    stats = sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0]
    # The next step recomputes from the first rejected position.
    request.spec_token_ids = [1]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 2}
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 17


def test_drafts_are_trimmed_to_the_budget():
    sched = make_scheduler(num_blocks=20, block_size=8, max_num_batched_tokens=3)
    request = make_request("a", [3, 4], max_tokens=20)
    sched.add_request(request)
    step(sched, 7)
    request.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 3}
    assert out.scheduled_spec_decode_tokens == {"a": [5, 6]}


def test_drafts_go_before_anyone_is_preempted():
    sched = make_scheduler(num_blocks=9, block_size=8)  # 8 usable pages
    a = make_request("a", list(range(10, 34)), max_tokens=20)  # 24 tokens: 3 pages
    b = make_request("b", list(range(40, 70)), max_tokens=20)  # 30 tokens: 4 pages
    sched.add_request(a)
    sched.add_request(b)
    step(sched, 7)
    assert sched.kv_cache_manager.pool.num_free_blocks == 1
    # a needs the free page for its next token; 8 drafts would need one more: they go, and b
    # (whose next token fits its last page) is not preempted.
    a.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.scheduled_spec_decode_tokens == {}
    assert sched.num_preemptions == 0 and a.spec_token_ids == []


def test_drafts_after_a_token_on_its_way_start_one_position_later():
    """A step scheduled while the one before it samples the request's next token (drafting
    ahead): that token's position comes first, the drafts after it; trimming keeps the first
    drafts; rejection rolls back to after the accepted ones."""
    sched = make_scheduler(num_blocks=10, block_size=8, max_num_batched_tokens=16)
    request = _prefilled(sched)
    first = sched.schedule()  # the last token, sampling the next: in flight
    assert first.num_scheduled_tokens == {"a": 1} and request.num_output_placeholders == 1
    assert request.num_computed_tokens == 15 and request.num_tokens == 15
    request.spec_token_ids = list(range(100, 120))
    ahead = sched.schedule()
    # Budget 16: the token on its way (position 15) and the first 15 drafts (16-30).
    assert ahead.num_scheduled_tokens == {"a": 16}
    assert ahead.scheduled_spec_decode_tokens == {"a": list(range(100, 115))}
    assert ahead.scheduled_cached_reqs[0].num_computed_tokens == 15
    assert request.num_computed_tokens == 31
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2, 3, 4]  # up to position 30
    sched.update_from_output(first, ModelRunnerOutput(["a"], [[4]]))
    assert request.num_tokens == 16 and request.num_output_placeholders == 1
    # One draft accepted, then the target's own token: 16 + 2 tokens, 17 computed.
    sched.update_from_output(ahead, ModelRunnerOutput(["a"], [[100, 9]]))
    assert request.output_token_ids == [7, 4, 100, 9]
    assert request.num_computed_tokens == 17 and request.num_tokens == 18
    assert request.num_output_placeholders == 0
    assert sched.spec_stats.num_accepted_tokens_per_pos[:3] == [1, 0, 0]


def test_lookahead_pages_for_a_draft_model_never_preempt():
    """A draft model writes its drafts' KV before the step that verifies them: the scheduler
    gives the request pages for its next token and the drafts, or none when too few are free."""
    sched = make_scheduler(num_blocks=4, block_size=8)  # 3 usable pages
    request = _prefilled(sched)
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2]
    # 14 computed, the next token and 3 drafts: 18 positions, a third page.
    assert sched.allocate_lookahead(request, 3) == [3]
    assert sched.allocate_lookahead(request, 3) == []  # held already
    assert sched.allocate_lookahead(request, 10) is None  # 25 positions: a fourth page
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2, 3]
    assert request in sched.running and sched.num_preemptions == 0
