"""Fixtures the engine tests share: the tiny Qwen3 checkpoint they run, and an event loop per
module for the tests that drive an async client by hand."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen3"))
