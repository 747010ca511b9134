"""One tiny-model server for the Messages tests, its tokenizer carrying Qwen3's chat template (tools,
thinking switch) with its tags as single tokens, served with the hermes tool parser and the qwen3
reasoning parser, as Qwen3 is served; and the official `anthropic` client for it."""

from __future__ import annotations

import pytest

from tests.conftest import build_checkpoint, build_tokenizer
from tests.entrypoints.openai.server import API_KEY, SERVED_NAME, RemoteServer
from tests.entrypoints.test_chat_messages import load_template

QWEN3_SPECIALS = (
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
)


def qwen3_checkpoint(folder):
    """The tiny qwen3 checkpoint with Qwen3's chat template and tags."""
    build_checkpoint("qwen3", folder)
    tokenizer = build_tokenizer(QWEN3_SPECIALS)
    tokenizer.chat_template = load_template("qwen3")
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def messages_server(tmp_path_factory):
    folder = qwen3_checkpoint(tmp_path_factory.mktemp("qwen3-template"))
    server = RemoteServer(
        folder,
        "--max-model-len",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client(messages_server):
    import anthropic

    return anthropic.Anthropic(base_url=messages_server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def http(messages_server):
    """A plain HTTP client that sends the key as Anthropic's clients do (`x-api-key`)."""
    import httpx

    with httpx.Client(
        base_url=messages_server.url, headers={"x-api-key": API_KEY}, timeout=120
    ) as c:
        yield c


__all__ = ["SERVED_NAME"]
