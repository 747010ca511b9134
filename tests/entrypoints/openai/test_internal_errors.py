"""A bug behind the gate is a 500 logged once, its client's values cut short, and the gate does not
re-raise it (uvicorn would log it a second time and close the keep-alive connection); in-process,
over the real gate and error handlers with a route that fails."""

from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from inferengine.entrypoints.openai.errors import MAX_MESSAGE_CHARS, install_error_handlers
from inferengine.entrypoints.openai.middleware import GateMiddleware
from tests.conftest import logged_messages


class _State:
    api_key: str | None = None
    max_request_body_bytes = 1 << 20
    draining = False
    in_flight = 0

    def __init__(self) -> None:
        self.cut_off = asyncio.Event()


@pytest.fixture
def errors():
    """ERROR records of the package logger (it does not propagate to caplog)."""
    with logged_messages(logging.ERROR) as messages:
        yield messages


@pytest.fixture
def client():
    app = FastAPI()

    @app.post("/v1/fails")
    async def fails(body: dict) -> dict:
        raise KeyError(body["key"])

    @app.post("/v1/works")
    async def works() -> dict:
        return {"ok": True}

    state = _State()
    app.add_middleware(GateMiddleware, state=state)
    install_error_handlers(app)
    # raise_server_exceptions: an error the gate re-raised would fail the test here.
    with TestClient(app, raise_server_exceptions=True) as c:
        yield c, state


def test_a_bug_is_a_500_logged_once_with_a_short_message(client, errors):
    c, state = client
    response = c.post("/v1/fails", json={"key": "secret" * 100_000})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_error" and error["code"] == 500
    assert error["message"].startswith("internal error: KeyError: 'secretsecret")
    assert len(error["message"]) <= MAX_MESSAGE_CHARS + 40
    assert len(errors) == 1, errors
    assert "Traceback" in errors[0] and "in fails" in errors[0]
    assert len(errors[0]) < 5000 and "characters in all" in errors[0]
    assert state.in_flight == 0
    assert c.post("/v1/works").json() == {"ok": True}
