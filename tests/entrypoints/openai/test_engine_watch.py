"""The server's engine watch: it stops the server once the engine is gone, and only then; with
data-parallel replicas, a dead replica whose peers still serve is no reason to stop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from inferengine.dp.client import DPClient
from inferengine.engine.core_client import exit_reason
from inferengine.entrypoints.openai.api_server import ServerState
from tests.dp.test_client import make_client


class ClientEngine:
    """`AsyncLLM`'s health, over a real engine-core client."""

    def __init__(self, client: DPClient):
        self.client = client

    @property
    def is_running(self) -> bool:
        return not self.client.is_dead

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason


def watch(engine: ClientEngine, fatal: list[str]) -> asyncio.Task:
    """`ServerState`'s watch, on a state with just what it reads."""
    state = SimpleNamespace(in_flight=0, on_fatal=fatal.append)
    return asyncio.create_task(ServerState._watch_engine(state, engine))  # type: ignore[arg-type]


def test_a_dead_replica_keeps_the_server_up_the_last_one_stops_it(monkeypatch):
    monkeypatch.setattr("inferengine.dp.client.READY_RETRIES", 1)
    monkeypatch.setattr("inferengine.envs.engine_startup_timeout_s", lambda: 0.2)

    async def go() -> list[str]:
        client, (a, b) = make_client()
        await client.wait_until_ready()
        fatal: list[str] = []
        task = watch(ClientEngine(client), fatal)
        a.kill(comes_back=False)
        await asyncio.sleep(1.5)  # replica 0 is given up on; replica 1 serves
        assert [s.status for s in client.slots] == ["dead", "up"]
        assert fatal == [] and not task.done()
        b.kill(comes_back=False)
        await asyncio.wait_for(task, 5)
        client.shutdown()
        return fatal

    (message,) = asyncio.run(go())
    assert message == (
        "engine core died (every replica stopped); shutting down the API server so a "
        "supervisor can restart it"
    )


def test_the_watch_waits_for_failed_requests_to_answer():
    async def go() -> list[str]:
        engine = ClientEngine(SimpleNamespace(is_dead=True, dead_reason="exit code 1"))
        fatal: list[str] = []
        state = SimpleNamespace(in_flight=1, on_fatal=fatal.append)
        task = asyncio.create_task(ServerState._watch_engine(state, engine))  # type: ignore[arg-type]
        await asyncio.sleep(0.3)
        assert fatal == []  # a request is still sending its error
        state.in_flight = 0
        await asyncio.wait_for(task, 1)
        return fatal

    assert asyncio.run(go()) == [
        "engine core died (exit code 1); shutting down the API server so a supervisor can "
        "restart it"
    ]


def test_exit_reason_names_the_signal():
    assert exit_reason(-9) == "exit code -9 (SIGKILL)"
    assert exit_reason(1) == "exit code 1"
    assert exit_reason(None) == "exit code None"
