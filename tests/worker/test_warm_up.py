"""The start-up warm-up: its plan covers the eager step sizes and sampler paths, it runs through
the runner on the null page only, and an engine warmed up answers exactly like a cold one with
its KV pool and prefix cache untouched."""

from __future__ import annotations

import time

import torch

from inferengine.engine.arg_utils import EngineArgs
from inferengine.engine.llm_engine import LLMEngine
from inferengine.sampling_params import SamplingParams
from inferengine.worker.warm_up import SAMPLER_VARIANTS, prefill_buckets, warm_up, warmup_plan
from tests.conftest import logged_messages
from tests.worker.runner_helpers import BS, make_runner


def test_prefill_buckets_double_from_above_the_graphs_to_the_budget():
    assert prefill_buckets(8192, 2048) == [4096, 8192]
    assert prefill_buckets(16384, 2048) == [4096, 8192, 16384]
    assert prefill_buckets(6000, 2048) == [4096, 6000]
    assert prefill_buckets(2048, 2048) == []  # every step fits a graph
    assert prefill_buckets(2048, 0) == [2048]  # no graphs: the budget alone


def test_plan_at_the_qwen_serving_shape():
    plan = {s.label: s for s in warmup_plan(8192, 8192, 256, 2048)}
    totals = {label: sum(r.tokens for r in s.requests) for label, s in plan.items()}
    assert totals["prefill 4096"] == 4096 and totals["prefill 8192"] == 8192
    # Two sequences, a size that is no multiple of 16.
    assert totals["prefill 8191 in 2+"] == 8191 and len(plan["prefill 8191 in 2+"].requests) == 2
    (long,) = plan["chunk 4096 after 4096"].requests
    assert (long.context, long.tokens) == (4096, 4096)
    mixed = plan["mixed 8 decodes + 8184"].requests
    assert [(r.context, r.tokens) for r in mixed[:8]] == [(8191, 1)] * 8
    assert sum(r.tokens for r in mixed) == 8192
    for name in SAMPLER_VARIANTS:
        assert plan[f"sampler {name}"].requests[0].params == SAMPLER_VARIANTS[name]
    assert plan["grammar mask"].grammar


def test_plan_respects_the_sequence_length_and_rows():
    plan = warmup_plan(8192, 2048, 4, 2048)
    for step in plan:
        assert len(step.requests) <= 4
        assert all(r.context + r.tokens <= 2048 for r in step.requests)
    assert [sum(r.tokens for r in s.requests) for s in plan[:2]] == [4096, 8192]


def test_warm_up_runs_the_plan_on_the_null_page_and_leaves_no_trace():
    runner, model = make_runner(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    runner.kv_caches = [torch.arange(2 * 6 * BS * 4, dtype=torch.float32).view(2, 6, BS, 1, 4)]
    before = runner.kv_caches[0].clone()
    rng = torch.get_rng_state()
    labels = warm_up(runner)
    assert labels == [s.label for s in warmup_plan(32, 32, 4, 0)]
    plan = warmup_plan(32, 32, 4, 0)
    assert [c["num_actual_tokens"] for c in model.calls] == [
        sum(r.tokens for r in s.requests) for s in plan
    ]
    assert model.calls[0]["num_actual_tokens"] == 32  # the budget, in one eager step
    assert all(0 <= s < BS for call in model.calls for s in call["slots"])  # block 0 only
    assert all(b == 0 for call in model.calls for row in call["table"] for b in row)
    assert torch.equal(runner.kv_caches[0], before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert runner.requests == {} and runner._last is None
    assert sorted(runner.buffers.free_rows) == [0, 1, 2, 3]
    # The sampler saw every variant.
    seen = runner.sampler.seen
    assert any(md.top_p is not None for md in seen) and len(seen) >= len(SAMPLER_VARIANTS)


def _engine(path: str, warmup: bool) -> LLMEngine:
    args = EngineArgs(model=path, max_model_len=128, max_num_seqs=4, warmup=warmup)
    return LLMEngine(args.create_engine_config())


def _answers(engine: LLMEngine) -> list[list[int]]:
    prompts = [[5, 9, 17, 33, 65, 129, 2, 3], [7, 11, 13, 17, 19, 23]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),  # the global RNG
    ]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
    done: dict[str, list[int]] = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_engine_after_warm_up_is_a_cold_engine(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    cold = _answers(_engine(path, warmup=False))
    start = time.perf_counter()
    with logged_messages() as messages:
        engine = _engine(path, warmup=True)
    print(f"start-up with warm-up: {time.perf_counter() - start:.2f} s")
    (logged,) = [m for m in messages if m.startswith("warm-up:")]
    assert "kernel variants in" in logged and "sampler penalties" in logged
    runner = engine.core.executor.worker.runner
    pool = engine.core.scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1 and pool.num_cached_free_blocks == 0
    assert pool.cached == {}  # no prefix hash registered
    assert all(not c.any() for c in runner.kv_caches)  # no page written, the null one included
    assert runner.requests == {} and len(runner.buffers.free_rows) == 4
    # Greedy and unseeded sampling (the global RNG): the same tokens as without warm-up.
    assert _answers(engine) == cold
