"""The engine view in a real browser: its numbers move while a load runs, a session's lease
shows up, and both views fit a 375 px wide phone."""

from __future__ import annotations

import threading

import httpx
from playwright.sync_api import expect

from tests.entrypoints.web.conftest import open_page

SESSION_KEY = "web-test-session"
# A figure of the engine view as a number (functions, not strings: the page's CSP forbids eval).
STAT = "((name) => Number(document.querySelector(`[data-stat='${name}']`).textContent))"


def load(server, stop: threading.Event, n: int = 3, max_tokens: int = 96) -> threading.Thread:
    """`n` clients streaming requests one after another until `stop` is set (the first client's
    requests lease a session). The view polls /stats once a second, and a tiny model on a quiet
    machine ends a 96-token request well within that: a load of single requests could start and
    end between two polls, never seen running."""

    def one(k: int) -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Count to a hundred, {k}"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        if k == 0:
            body |= {"prompt_cache_key": SESSION_KEY, "prompt_cache_retention": "1h"}
        with server.client() as client:
            while not stop.is_set():
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    runner = threading.Thread(target=lambda: [t.join() for t in threads])
    runner.start()
    return runner


def test_the_numbers_move_while_a_load_runs(page, web_server):
    page.click("#tab-engine")
    expect(page.locator('[data-stat="running"]')).to_have_text("0")
    before = page.locator("#chart-tokens polyline").nth(1).get_attribute("points")
    stop = threading.Event()
    runner = load(web_server, stop)
    try:
        page.wait_for_function(f"() => {STAT}('running') > 0")
        page.wait_for_function(f"() => {STAT}('gen-tps') > 0")
        assert page.locator("#chart-tokens polyline").nth(1).get_attribute("points") != before
        expect(page.locator("#sessions")).to_contain_text(SESSION_KEY, timeout=60_000)
    finally:
        stop.set()
        runner.join(120)
    page.wait_for_function(f"() => {STAT}('running') === 0")
    assert "of" in page.locator('[data-stat="kv-used"]').inner_text()
    assert page.errors == []


def test_stats_lists_leased_sessions(web_server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Remember me"}],
        "max_tokens": 2,
        "prompt_cache_key": "stats-session",
        "prompt_cache_retention": "10m",
    }
    with web_server.client() as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    stats = web_server.stats()
    leases = {s["key"]: s["expires_in_s"] for s in stats["sessions"]}
    assert 590 < leases["stats-session"] <= 600
    assert stats["num_structured_output_requests"] == 0


def test_both_views_fit_a_phone(browser, web_server):
    context, page, errors = open_page(browser, web_server.url + "/", width=375, height=800)
    try:
        expect(page.locator("#server-status")).to_have_text("tiny · ready")
        for tab in ("#tab-chat", "#tab-engine"):
            page.click(tab)
            page.wait_for_timeout(100)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 375, f"{tab}: the page is {width} px wide"
        expect(page.locator("#chat-settings")).not_to_have_attribute("open", "")
        assert errors == []
    finally:
        context.close()


def test_the_page_asks_for_the_key_once_and_keeps_it_in_the_tab(browser, web_server):
    context, page, _ = open_page(browser, web_server.url + "/", key=None)
    try:
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()
        expect(page.locator("#key-message")).to_have_text("This server needs an API key.")
        page.fill("#key-input", "wrong-key")
        page.click("#key-form button")
        expect(page.locator("#key-message")).to_have_text("The server refused that key.")
        expect(dialog).to_be_visible()
        page.fill("#key-input", web_server.api_key)
        page.click("#key-form button")
        expect(dialog).to_be_hidden()
        expect(page.locator("#model option")).to_have_text(["tiny"])
        expect(page.locator("#server-status")).to_have_text("tiny · ready")
        stored = page.evaluate(
            "[sessionStorage.getItem('inferengine.apiKey'), localStorage.length, document.cookie]"
        )
        assert stored == [web_server.api_key, 0, ""]
        # The page and its files came without the key; the API still needs it.
        assert httpx.get(web_server.url + "/").status_code == 200
        assert httpx.get(web_server.url + "/web/app.js").status_code == 200
        assert httpx.get(web_server.url + "/stats").status_code == 401
    finally:
        context.close()
