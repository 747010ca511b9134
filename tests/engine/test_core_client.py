"""`AsyncMPClient` against a real engine-core process on a tiny model: requests, aborts and
utility calls over ZMQ, refusals the core makes itself, a core that fails to start, and a core
that stops (every caller then gets `EngineDeadError`). One process serves the module; the last
test stops it."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import pytest
import torch

from inferengine.core.engine_io import EngineCoreRequest, SchedulerStats
from inferengine.core.request import FinishReason
from inferengine.engine.arg_utils import EngineArgs
from inferengine.engine.core_client import AsyncMPClient, exit_reason
from inferengine.engine.core_proc import Msg
from inferengine.errors import EngineDeadError
from inferengine.sampling_params import SamplingParams
from tests.conftest import EOS_ID, hf_greedy, hf_model

PROMPT = torch.randint(2, 320, (12,), generator=torch.Generator().manual_seed(2)).tolist()
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def client(path, loop):
    config = EngineArgs(model=path, max_model_len=128, max_num_seqs=4).create_engine_config()
    client = AsyncMPClient(config)
    try:
        loop.run_until_complete(asyncio.wait_for(client.wait_until_ready(), TIMEOUT_S))
        yield client
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def reference(path) -> list[int]:
    return hf_greedy(hf_model(path), PROMPT, 8)


def request(request_id: str, max_tokens: int = 8, prompt: list[int] = PROMPT, **params):
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return EngineCoreRequest(request_id, list(prompt), sampling, eos_token_id=EOS_ID)


async def collect(client: AsyncMPClient, request_ids: set[str]) -> dict[str, list]:
    """Every output of these requests until each has finished (others' outputs are dropped),
    and the errors the core sent for them."""
    outputs: dict[str, list] = {r: [] for r in request_ids}
    errors: dict[str, str] = {}
    unfinished = set(request_ids)
    while unfinished:
        batch = await asyncio.wait_for(client.get_output(), TIMEOUT_S)
        errors |= {k: v for k, v in batch.errors.items() if k in request_ids}
        for out in batch.outputs:
            if out.request_id in outputs:
                outputs[out.request_id].append(out)
                if out.finish_reason is not None:
                    unfinished.discard(out.request_id)
    return {"outputs": outputs, "errors": errors}


def test_ready_info_describes_the_core(client):
    info = client.ready_info
    assert info["pid"] == client.proc.pid != os.getpid()
    assert info["max_model_len"] == 128
    assert info["num_blocks"] == 4 * 128 // 16 + 8 + 1  # max_num_seqs requests, a quarter more
    assert info["attention_backend"] == "cpu"
    assert not client.is_dead and client.dead_reason is None


def test_requests_come_back_as_transformers_greedy_tokens(client, loop, reference):
    async def go():
        await client.add_request(request("a"))
        await client.add_request(request("b", max_tokens=3))
        return await collect(client, {"a", "b"})

    got = loop.run_until_complete(go())
    outputs = got["outputs"]
    assert [t for out in outputs["a"] for t in out.new_token_ids] == reference
    assert [t for out in outputs["b"] for t in out.new_token_ids] == reference[:3]
    assert outputs["a"][-1].finish_reason == FinishReason.LENGTH
    first = outputs["a"][0]
    assert 0 < first.queued_time <= first.scheduled_time  # stamped on the first output only
    assert all(out.scheduled_time == 0 for out in outputs["a"][1:])
    assert got["errors"] == {}


def test_logprobs_cross_the_process_boundary(client, loop, reference):
    async def go():
        await client.add_request(request("lp", max_tokens=2, logprobs=3))
        return await collect(client, {"lp"})

    outputs = loop.run_until_complete(go())["outputs"]["lp"]
    rows = [out.new_logprobs for out in outputs if out.new_logprobs is not None]
    ids = [row for lp in rows for row in lp.token_ids]
    ranks = [rank for lp in rows for rank in lp.ranks]
    assert [r[0] for r in ids] == reference[:2] and ranks == [1, 1]  # greedy: the top token
    assert all(len(r) == 4 and r[1] == r[0] for r in ids)  # the chosen one, then the top 3


def test_the_core_refuses_what_it_cannot_serve_and_keeps_serving(client, loop, reference):
    async def go():
        await client.add_request(request("bad", prompt=[5, 100000]))
        await client.add_request(request("empty", prompt=[]))
        await client.add_request(request("ok", max_tokens=2))
        return await collect(client, {"bad", "empty", "ok"})

    got = loop.run_until_complete(go())
    assert got["errors"] == {
        "bad": "the prompt has token ids outside the vocabulary [0, 320).",
        "empty": "the prompt is empty; send at least one token.",
    }
    for rid in ("bad", "empty"):
        (out,) = got["outputs"][rid]
        assert (out.new_token_ids, out.finish_reason) == ([], FinishReason.ABORT)
    assert [t for out in got["outputs"]["ok"] for t in out.new_token_ids] == reference[:2]


def test_an_abort_stops_the_request_in_the_core(client, loop):
    async def go():
        await client.add_request(request("long", max_tokens=100))
        while not any(o.request_id == "long" for o in (await client.get_output()).outputs):
            pass
        await client.abort_requests(["long"])
        await client.abort_requests([])  # nothing to send
        # messages are handled in order: the stats are taken after the abort
        return msgspec.convert(await client.call_utility("get_stats"), SchedulerStats)

    stats = loop.run_until_complete(asyncio.wait_for(go(), TIMEOUT_S))
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert (
        stats.num_free_blocks == stats.num_blocks == 40
    )  # its pages are back (null page not counted)


def test_utility_calls(client, loop):
    async def go():
        return (
            await client.call_utility("ping"),
            await client.call_utility("reset_prefix_cache"),
            await client.call_utility("device_memory"),
        )

    assert loop.run_until_complete(go()) == ("pong", True, None)  # no GPU memory on the CPU
    with pytest.raises(RuntimeError, match="unknown utility 'nope'"):
        loop.run_until_complete(client.call_utility("nope"))


def test_a_core_that_stops_fails_every_caller(client, loop):
    """The core leaves on a SHUTDOWN message (exit code 0); the client notices the process is
    gone, and from then on every call raises `EngineDeadError` with the reason."""

    async def go():
        await client.input_socket.send_multipart([Msg.SHUTDOWN.value, b"\xc0"])
        with pytest.raises(EngineDeadError, match="the engine core stopped: exit code 0"):
            while True:  # outputs sent before (of the aborted request) come first
                await asyncio.wait_for(client.get_output(), TIMEOUT_S)
        with pytest.raises(EngineDeadError, match="the engine core stopped: exit code 0"):
            await client.get_output()  # every later caller too
        with pytest.raises(EngineDeadError, match=r"not running \(exit code 0\)"):
            await client.add_request(request("late"))
        with pytest.raises(EngineDeadError, match="not running"):
            await client.call_utility("ping")
        await client.abort_requests(["late"])  # a no-op, not an error

    loop.run_until_complete(go())
    assert client.is_dead and client.dead_reason == "exit code 0"
    assert client.proc.exitcode == 0


def test_a_core_that_fails_to_start_says_why(path):
    """The core's cache cannot hold one request of the explicit --max-model-len: its ConfigError
    reaches the client, and the process has exited."""
    config = EngineArgs(
        model=path, max_model_len=1024, kv_cache_memory=1 << 16
    ).create_engine_config()
    client = AsyncMPClient(config)

    async def go():
        with pytest.raises(EngineDeadError) as info:
            await asyncio.wait_for(client.wait_until_ready(), TIMEOUT_S)
        return info.value.message

    try:
        message = asyncio.run(go())
        client.proc.join(TIMEOUT_S)
    finally:
        client.shutdown()
    assert message.startswith("the engine core failed to start: ConfigError: the KV cache holds ")
    assert "Lower --max-model-len to" in message
    assert client.proc.exitcode == 1 and client.is_dead


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (1, "exit code 1"),
        (0, "exit code 0"),
        (-signal.SIGKILL, "exit code -9 (SIGKILL)"),
        (-signal.SIGTERM, "exit code -15 (SIGTERM)"),
        (-1000, "exit code -1000"),
        (None, "exit code None"),
    ],
)
def test_exit_reason_names_the_signal(code, reason):
    assert exit_reason(code) == reason
