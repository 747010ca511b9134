"""One tiny-model server for the whole session (the engine starts once) and clients for it."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.server import API_KEY, RemoteServer

MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def tiny_server(tiny_checkpoint):
    server = RemoteServer(tiny_checkpoint("qwen3"), "--max-model-len", str(MAX_MODEL_LEN))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def openai_client(tiny_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0)
