"""The engine-core process's loop, run in a thread over real ZMQ sockets with a scripted core:
READY first, requests and aborts handed to the core, its outputs sent back, utility calls
answered between steps, SHUTDOWN leaving the loop, a core that fails to build reported."""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import msgspec
import pytest
import zmq

import inferengine.engine.core as core_module
from inferengine.core.engine_io import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from inferengine.engine.core_proc import EngineCoreProc, Msg, UtilityResult, run_utility
from inferengine.sampling_params import SamplingParams

encode = msgspec.msgpack.encode
TIMEOUT_MS = 10_000


class ScriptedCore:
    """An `EngineCore` stand-in: each request yields one token per step, then finishes; with
    `num_tokens=None`, one token and then nothing until it is aborted."""

    def __init__(self, config, num_tokens: int | None = 2):
        self.config = config
        self.num_tokens = num_tokens
        self.executor = SimpleNamespace(
            attention_backend_name="scripted", attention_backend_timings_ms={"a": 1.5}
        )
        self.scheduler = SimpleNamespace(
            make_stats=lambda: SchedulerStats(num_running=len(self.live))
        )
        self.live: dict[str, int] = {}
        self.added: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.shut_down = False

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request)
        self.live[request.request_id] = 0

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        for request_id in request_ids:
            self.live.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> EngineCoreOutputs:
        outputs = []
        if self.num_tokens is None:
            time.sleep(0.001)  # a step of the endless request: no new token
        for request_id in list(self.live):
            if self.num_tokens is None and self.live[request_id]:
                continue
            self.live[request_id] += 1
            done = self.live[request_id] == self.num_tokens
            outputs.append(
                EngineCoreOutput(request_id, [100 + self.live[request_id]], 1 if done else None)
            )
            if done:
                del self.live[request_id]
        return EngineCoreOutputs(outputs)

    def reset_prefix_cache(self) -> bool:
        return True

    def expert_token_counts(self) -> dict[int, list[int]]:
        raise ValueError("boom")

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self.shut_down = True


CONFIG = SimpleNamespace(
    cache_config=SimpleNamespace(num_blocks=41),
    scheduler_config=SimpleNamespace(max_model_len=128),
    device="cpu",
)


class Harness:
    """The API side's two sockets, bound, as `AsyncMPClient` binds them."""

    def __init__(self):
        base = f"ipc:///tmp/inferengine-test-{uuid.uuid4().hex[:12]}"
        self.in_addr, self.out_addr = f"{base}-in", f"{base}-out"
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(self.in_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.out_addr)

    def send(self, msg: Msg, payload) -> None:
        self.push.send_multipart([msg.value, encode(payload)])

    def recv(self) -> tuple[Msg, bytes]:
        assert self.pull.poll(TIMEOUT_MS), "nothing from the core"
        kind, payload = self.pull.recv_multipart()
        return Msg(kind), payload

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def start(harness: Harness, monkeypatch, core_cls=ScriptedCore):
    monkeypatch.setattr(core_module, "EngineCore", core_cls)
    proc = EngineCoreProc(CONFIG, harness.in_addr, harness.out_addr)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    return proc, thread


def test_ready_then_requests_outputs_and_aborts(harness, monkeypatch):
    proc, thread = start(harness, monkeypatch)
    kind, payload = harness.recv()
    assert kind == Msg.READY
    ready = msgspec.msgpack.decode(payload)
    assert ready == {
        "num_blocks": 41,
        "max_model_len": 128,
        "attention_backend": "scripted",
        "attention_backend_timings_ms": {"a": 1.5},
        "pid": ready["pid"],
    }
    request = EngineCoreRequest("r", [5, 6], SamplingParams(max_tokens=2), eos_token_id=1)
    harness.send(Msg.ADD, request)
    tokens = []
    while True:
        kind, payload = harness.recv()
        assert kind == Msg.OUTPUTS
        (out,) = msgspec.msgpack.decode(payload, type=EngineCoreOutputs).outputs
        tokens += out.new_token_ids
        if out.finish_reason is not None:
            break
    assert tokens == [101, 102]
    (added,) = proc.core.added
    assert added == request  # decoded as sent, sampling parameters included
    harness.send(Msg.ABORT, ["x", "y"])
    harness.send(Msg.UTILITY, [3, "ping", []])  # handled after the abort
    kind, payload = harness.recv()
    assert kind == Msg.UTILITY_RESULT
    assert msgspec.msgpack.decode(payload, type=UtilityResult) == UtilityResult(3, "pong")
    assert proc.core.aborted == ["x", "y"]
    harness.send(Msg.SHUTDOWN, None)
    thread.join(10)
    assert not thread.is_alive()  # the loop returned
    proc.shutdown()
    assert proc.core.shut_down


def test_utility_calls_are_answered_between_steps(harness, monkeypatch):
    _, thread = start(harness, monkeypatch, lambda config: ScriptedCore(config, num_tokens=None))
    assert harness.recv()[0] == Msg.READY
    harness.send(Msg.ADD, EngineCoreRequest("long", [5], SamplingParams(max_tokens=50)))
    assert harness.recv()[0] == Msg.OUTPUTS  # its one token: the core steps it
    harness.send(Msg.UTILITY, [9, "get_stats", []])
    kind, payload = harness.recv()
    assert kind == Msg.UTILITY_RESULT
    result = msgspec.msgpack.decode(payload, type=UtilityResult)
    assert result.call_id == 9
    assert msgspec.convert(result.result, SchedulerStats).num_running == 1
    harness.send(Msg.ABORT, ["long"])
    harness.send(Msg.SHUTDOWN, None)
    thread.join(10)
    assert not thread.is_alive()


def test_a_core_that_cannot_be_built_is_reported(harness, monkeypatch):
    def failing(config):
        raise RuntimeError("no weights")

    monkeypatch.setattr(core_module, "EngineCore", failing)
    with pytest.raises(RuntimeError, match="no weights"):
        EngineCoreProc(CONFIG, harness.in_addr, harness.out_addr)
    kind, payload = harness.recv()
    assert kind == Msg.FAILED
    assert msgspec.msgpack.decode(payload) == "RuntimeError: no weights"


# ---- utilities ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("ping", UtilityResult(1, "pong")),
        ("reset_prefix_cache", UtilityResult(1, True)),
        ("get_stats", UtilityResult(1, SchedulerStats(num_running=0))),
        ("device_memory", UtilityResult(1, None)),  # on the CPU
        ("expert_token_counts", UtilityResult(1, error="ValueError: boom")),
        ("drop_tables", UtilityResult(1, error="unknown utility 'drop_tables'")),
    ],
)
def test_run_utility(method, expected):
    assert run_utility(ScriptedCore(CONFIG), 1, method, []) == expected


def test_messages_are_one_distinct_byte():
    assert all(len(m.value) == 1 for m in Msg)
    assert len({m.value for m in Msg}) == len(Msg)
    result = UtilityResult(4, {"a": [1, 2]}, None)
    assert msgspec.msgpack.decode(encode(result), type=UtilityResult) == result
