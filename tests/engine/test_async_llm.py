"""`AsyncLLM` over a real engine-core process on a tiny model: streams in each output kind,
`n` fanned out, a caller that stops listening aborts its request in the core, stop strings,
admission control, stats, and a dead core failing the streams. One engine serves the module;
the last test kills its core."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal

import pytest
import torch

from inferengine.engine.arg_utils import EngineArgs
from inferengine.engine.async_llm import AsyncLLM, RequestCollector
from inferengine.errors import EngineDeadError, InvalidRequestError, OverloadedError
from inferengine.outputs import CompletionOutput, RequestOutput
from inferengine.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import hf_greedy, hf_model

PROMPT = torch.randint(2, 320, (12,), generator=torch.Generator().manual_seed(2)).tolist()
PAGE_BYTES = 2 * 3 * 16 * 1 * 32 * 4  # K and V, 3 layers, 16 tokens, 1 KV head of 32, fp32
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def llm(path, loop):
    """No --max-model-len, and a cache of 33 pages (32 usable): the core lowers the model's
    1024 to 512 tokens, and tells the API side."""
    config = EngineArgs(
        model=path, max_num_seqs=4, kv_cache_memory=33 * PAGE_BYTES
    ).create_engine_config()
    engine = AsyncLLM(config)
    try:
        loop.run_until_complete(asyncio.wait_for(engine.start(), TIMEOUT_S))
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(path) -> list[int]:
    return hf_greedy(hf_model(path), PROMPT, 8)


def greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def prompt_ids(ids: list[int] = PROMPT) -> dict:
    return {"prompt_token_ids": ids}


async def all_outputs(llm: AsyncLLM, params: SamplingParams, request_id: str, prompt=None):
    outputs = []
    async for out in llm.generate(prompt or prompt_ids(), params, request_id):
        outputs.append(out)
    return outputs


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, TIMEOUT_S))


async def stats(llm: AsyncLLM) -> dict:
    await llm.refresh_stats()
    return llm.get_stats()


def test_the_cores_lowered_max_model_len_reaches_the_api_side(llm, loop):
    assert llm.ready_info["max_model_len"] == 512
    assert llm.model_config.max_model_len == llm.config.scheduler_config.max_model_len == 512
    with pytest.raises(InvalidRequestError, match=r"the prompt has 513 tokens.*\(512\)"):
        run(loop, all_outputs(llm, greedy(), "long", prompt_ids([5] * 513)))
    assert llm.num_unfinished_requests == 0


def test_a_cumulative_stream_grows_to_transformers_greedy_tokens(llm, loop, reference):
    outputs = run(loop, all_outputs(llm, greedy(), "c"))
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens[-1] == reference
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(tokens))
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    final = outputs[-1]
    assert final.request_id == "c" and final.prompt_token_ids == PROMPT
    assert final.outputs[0].text == llm.tokenizer.decode(reference, skip_special_tokens=True)
    assert final.outputs[0].finish_reason == "length"
    assert llm.num_unfinished_requests == 0


def test_deltas_add_up_and_final_only_sends_one(llm, loop, reference):
    deltas = run(loop, all_outputs(llm, greedy(output_kind=RequestOutputKind.DELTA), "d"))
    assert [t for o in deltas for t in o.outputs[0].token_ids] == reference
    text = "".join(o.outputs[0].text for o in deltas)
    assert text == llm.tokenizer.decode(reference, skip_special_tokens=True)
    (final,) = run(loop, all_outputs(llm, greedy(output_kind=RequestOutputKind.FINAL_ONLY), "f"))
    assert final.finished and final.outputs[0].token_ids == reference


def test_a_text_prompt_is_tokenized(llm, loop, path):
    (final,) = run(
        loop, all_outputs(llm, greedy(4, output_kind=RequestOutputKind.FINAL_ONLY), "t", "Hello")
    )
    ids = llm.tokenizer.encode("Hello")
    assert (final.prompt, final.prompt_token_ids) == ("Hello", ids)
    assert final.outputs[0].token_ids == hf_greedy(hf_model(path), ids, 4)


def test_n_fans_out_and_gathers_under_one_id(llm, loop, reference):
    (final,) = run(
        loop, all_outputs(llm, greedy(n=3, output_kind=RequestOutputKind.FINAL_ONLY), "n")
    )
    assert final.request_id == "n"
    assert [(c.index, c.token_ids) for c in final.outputs] == [(i, reference) for i in range(3)]
    deltas = run(loop, all_outputs(llm, greedy(n=2, output_kind=RequestOutputKind.DELTA), "nd"))
    by_child: dict[int, list[int]] = {0: [], 1: []}
    for out in deltas:
        for completion in out.outputs:  # deltas merged by the collector carry both children
            by_child[completion.index] += completion.token_ids
    assert by_child == {0: reference, 1: reference}
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    assert llm.num_unfinished_requests == 0 and llm.children == {}


def test_seeded_samples_are_reproducible_across_requests(llm, loop):
    params = SamplingParams(n=2, seed=77, temperature=1.0, max_tokens=8, ignore_eos=True)
    first = run(loop, all_outputs(llm, params, "s1"))[-1]
    again = run(loop, all_outputs(llm, params, "s2"))[-1]
    lone = SamplingParams(seed=78, temperature=1.0, max_tokens=8, ignore_eos=True)
    second_alone = run(loop, all_outputs(llm, lone, "s3"))[-1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert first.outputs[1].token_ids == second_alone.outputs[0].token_ids  # seed + 1


def test_leaving_the_stream_aborts_the_request_in_the_core(llm, loop):
    async def go():
        stream = llm.generate(prompt_ids(), greedy(400, n=2), "left")
        first = await stream.__anext__()
        assert llm.num_unfinished_requests == 1
        await stream.aclose()
        return first, await stats(llm)

    first, after = run(loop, go())
    assert not first.finished
    assert (after["num_requests_running"], after["num_requests_waiting"]) == (0, 0)
    assert after["num_requests_in_flight"] == 0 and llm.children == {}


def test_a_cancelled_consumer_aborts_its_request(llm, loop):
    async def go():
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate(prompt_ids(), greedy(400), "cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await stats(llm)

    after = run(loop, go())
    assert (after["num_requests_running"], after["num_requests_in_flight"]) == (0, 0)


def test_a_stop_string_ends_the_request_in_the_core(llm, loop, reference):
    full = llm.tokenizer.decode(reference, skip_special_tokens=True)
    stop = llm.tokenizer.decode(reference[2:4], skip_special_tokens=True)
    final = run(loop, all_outputs(llm, greedy(400, stop=[stop]), "stop"))[-1]
    completion = final.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.text == full[: full.find(stop)]
    assert len(completion.token_ids) < 400
    assert run(loop, stats(llm))["num_requests_running"] == 0


def test_a_request_id_in_use_is_refused(llm, loop, reference):
    async def go():
        stream = llm.generate(prompt_ids(), greedy(), "dup")
        first = await stream.__anext__()
        with pytest.raises(InvalidRequestError, match="request id 'dup' is already in use"):
            await all_outputs(llm, greedy(), "dup")
        rest = [out async for out in stream]
        return [first, *rest]

    outputs = run(loop, go())
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == reference


def test_past_capacity_requests_are_refused_with_overloaded(llm, loop):
    """With --max-waiting-requests W, max_num_seqs + W requests may be in flight."""
    scheduler_config = llm.config.scheduler_config
    scheduler_config.max_waiting_requests = 1  # 4 + 1

    async def go():
        streams = [llm.generate(prompt_ids(), greedy(100), f"cap{i}") for i in range(5)]
        firsts = [asyncio.ensure_future(stream.__anext__()) for stream in streams]
        while llm.num_unfinished_requests < 5:
            await asyncio.sleep(0.01)
        with pytest.raises(OverloadedError, match=r"at capacity \(5 requests in flight\)"):
            await all_outputs(llm, greedy(), "one-too-many")
        for first in firsts:
            first.cancel()  # leaving each stream aborts its request
        await asyncio.gather(*firsts, return_exceptions=True)
        for stream in streams:  # one whose first output came before the cancel
            await stream.aclose()
        return await stats(llm)

    try:
        after = run(loop, go())
    finally:
        scheduler_config.max_waiting_requests = None
    assert (after["num_requests_running"], after["num_requests_waiting"]) == (0, 0)


def test_stats_and_utilities(llm, loop):
    before = run(loop, stats(llm))
    prompt = prompt_ids([*PROMPT, *range(100, 128)])  # 40 tokens: 2 full pages
    run(loop, all_outputs(llm, greedy(2), "warm", prompt))
    run(loop, all_outputs(llm, greedy(2), "hit", prompt))
    stats_now = run(loop, stats(llm))
    assert stats_now["engine_running"] is True
    assert (stats_now["device"], stats_now["attention_backend"]) == ("cpu", "cpu")
    assert stats_now["model"] == llm.model_config.model
    assert stats_now["kv_pages_total"] == 32
    assert stats_now["prefix_cache_queries"] - before["prefix_cache_queries"] == 80
    assert stats_now["prefix_cache_hits"] - before["prefix_cache_hits"] == 32
    assert stats_now["kv_pages_cached"] >= 2
    assert stats_now["spec_decoding"] is None
    tiers = stats_now["kv_tiers"]
    assert tiers["gpu_hit_tokens"] - (before["kv_tiers"] or {}).get("gpu_hit_tokens", 0) == 32
    assert "cpu_pages_total" not in tiers  # no CPU tier
    assert run(loop, llm.reset_prefix_cache()) is True
    assert run(loop, stats(llm))["kv_pages_cached"] == 0


# ---- the collector -----------------------------------------------------------------------


def _out(index: int, text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(index, text, ids, finish_reason="length" if finished else None)
    return RequestOutput("r", None, [5], [completion], finished)


def test_a_lagging_consumer_gets_deltas_merged(loop):
    async def go():
        collector = RequestCollector(RequestOutputKind.DELTA)
        collector.put(_out(0, "Hel", [1]))
        collector.put(_out(1, "x", [9]))
        collector.put(_out(0, "lo", [2], finished=True))
        return await collector.get()

    merged = run(loop, go())
    assert [(c.index, c.text, c.token_ids) for c in merged.outputs] == [
        (0, "Hello", [1, 2]),
        (1, "x", [9]),
    ]
    assert merged.finished and merged.outputs[0].finish_reason == "length"


def test_a_cumulative_collector_keeps_the_newest_and_errors_win(loop):
    async def go():
        collector = RequestCollector(RequestOutputKind.CUMULATIVE)
        collector.put(_out(0, "Hel", [1]))
        collector.put(_out(0, "Hello", [1, 2]))
        newest = await collector.get()
        collector.put(_out(0, "Hello!", [1, 2, 3]))
        collector.put(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError, match="gone"):
            await collector.get()
        return newest

    assert run(loop, go()).outputs[0].text == "Hello"


# ---- a dead core (last: it ends the module's engine) -------------------------------------


def test_a_killed_core_fails_the_streams_and_new_requests(llm, loop):
    async def go():
        stream = llm.generate(prompt_ids(), greedy(400), "doomed")
        await stream.__anext__()
        os.kill(llm.client.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"exit code -9 \(SIGKILL\)"):
            async for _ in stream:
                pass

    run(loop, go())
    assert not llm.is_running
    assert llm.dead_reason == "exit code -9 (SIGKILL)"
    assert llm.get_stats()["engine_running"] is False
    with pytest.raises(EngineDeadError, match=r"the engine is not running \(exit code -9"):
        run(loop, all_outputs(llm, greedy(), "after"))
