"""A real browser (Playwright driving Debian's headless Chromium) and a tiny-model server with an
API key, for the web page's tests. Without Chromium or Playwright these tests skip, except in CI
(`CI` set), where they fail: `.ci/run` installs Chromium."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.entrypoints.openai.server import API_KEY, RemoteServer

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package (`apt-get install chromium`)
MAX_MODEL_LEN = 512


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _missing(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"{reason}; CI must run the browser tests (.ci/run installs Chromium)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def browser():
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install -e '.[dev]')")
    expect.set_options(timeout=30_000)  # not 5 s: a loaded 2-core box streams slowly
    if not CHROMIUM.exists():
        _missing(f"{CHROMIUM} is missing (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def web_server(tiny_checkpoint):
    """`inferengine serve` of a tiny model with `--api-key`: the page loads without the key and
    then needs it for every API call."""
    server = RemoteServer(tiny_checkpoint("qwen3"), "--max-model-len", str(MAX_MODEL_LEN))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def open_page(
    browser, url: str, *, key: str | None = API_KEY, width: int = 1440, height: int = 900
):
    """A fresh tab (its own sessionStorage) at `url`; with `key`, the tab already holds it, as
    if the user had entered it. Returns (context, page, errors)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    if key is not None:
        context.add_init_script(f"sessionStorage.setItem('inferengine.apiKey', {json.dumps(key)})")
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []  # console errors and uncaught exceptions, as they come
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.goto(url)
    return context, page, errors


@pytest.fixture
def page(browser, web_server):
    context, page, errors = open_page(browser, web_server.url + "/")
    page.errors = errors
    yield page
    context.close()
