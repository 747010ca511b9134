"""The chat in a real browser against a tiny-model server: it streams, keeps the conversation,
stops, shows its numbers; a reply with HTML in it (a canned stream) is shown as text."""

from __future__ import annotations

import json

from playwright.sync_api import Route, expect

MAX_TOKENS_STOPPED = 400  # far more than the test waits for: only the stop button ends it


def ignore_eos(route: Route) -> None:
    """Let the request through with `ignore_eos`, so that a random model's early end of text
    cannot end a reply the test means to stop (the page itself sends no such field)."""
    body = json.loads(route.request.post_data)
    route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))


def test_the_page_loads_without_console_errors(page):
    expect(page.locator("#server-status")).to_have_text("tiny · ready")
    expect(page.locator("#model option")).to_have_text(["tiny"])
    expect(page.locator("#key-dialog")).to_be_hidden()
    page.click("#tab-engine")
    expect(page.locator('[data-stat="running"]')).to_have_text("0")
    assert page.errors == []


def test_a_message_streams_an_answer_and_the_conversation_goes_on(page):
    bodies = []
    page.on(
        "request",
        lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/completions") else 0,
    )
    page.fill("#system-prompt", "Be brief.")
    page.fill("#max-tokens", "12")
    page.fill("#seed", "7")
    with page.expect_response("**/v1/chat/completions") as answer:
        page.fill("#prompt", "Hello there")
        page.press("#prompt", "Enter")
    assert answer.value.headers["content-type"].startswith("text/event-stream")
    meta = page.locator(".message.assistant .meta").first
    expect(meta).to_contain_text("completion tokens")
    assert "12 completion tokens" in meta.inner_text()
    assert "tokens/s" in meta.inner_text()
    first = bodies[0]
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["max_tokens"] == 12 and first["seed"] == 7
    assert "temperature" not in first and "top_p" not in first  # the server's defaults
    assert first["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]

    page.locator("#temperature").evaluate(
        "(e) => { e.value = '0.3'; e.dispatchEvent(new Event('input', {bubbles: true})); }"
    )
    page.fill("#prompt", "And then?")
    page.click("#send")
    expect(page.locator(".message.assistant .meta")).to_have_count(2)
    messages = bodies[1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] and messages[3]["content"] == "And then?"
    assert bodies[1]["temperature"] == 0.3 and "top_p" not in bodies[1]
    assert page.errors == []

    page.click("#clear")
    expect(page.locator(".message")).to_have_count(0)


def test_stop_ends_the_reply_and_the_engine_request(page, web_server):
    page.route("**/v1/chat/completions", ignore_eos)
    page.fill("#max-tokens", str(MAX_TOKENS_STOPPED))
    page.fill("#prompt", "Tell me a long story")
    page.click("#send")
    streaming = page.locator(".message.assistant .content.streaming")
    expect(streaming).not_to_have_text("")  # the first tokens arrived
    expect(page.locator("#stop")).to_be_enabled()
    page.click("#stop")
    meta = page.locator(".message.assistant .meta")
    expect(meta).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()
    # The server saw the client go and aborted the request.
    page.wait_for_function(
        """async () => {
            const r = await fetch('/stats', {headers: {Authorization:
                'Bearer ' + sessionStorage.getItem('inferengine.apiKey')}});
            return (await r.json()).num_requests_running === 0;
        }""",
        polling=200,
    )


CANNED_REPLY = [
    {"role": "assistant", "reasoning_content": "Think <b>hard</b> first."},
    {"content": "Here it is: <script>alert(1)</script> and **bold**\n\n"},
    {"content": "```html\n<img src=x onerror=alert(2)>\n```\n"},
    {"content": "[click me](javascript:alert(3)) <iframe src=/></iframe>"},
]


def canned_stream() -> str:
    chunks = [
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "model": "tiny",
            "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if k == 3 else None}],
        }
        for k, delta in enumerate(CANNED_REPLY)
    ]
    chunks.append({"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_a_reply_with_html_in_it_is_shown_as_text(page):
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=canned_stream()
        ),
    )
    page.fill("#prompt", "Show me some HTML")
    page.click("#send")
    reply = page.locator(".message.assistant")
    expect(reply.locator(".meta")).to_contain_text("5 prompt + 9 completion tokens")
    content = reply.locator(".content")
    assert "<script>alert(1)</script>" in content.inner_text()
    assert "<iframe src=/></iframe>" in content.inner_text()
    assert content.locator("pre code").inner_text() == "<img src=x onerror=alert(2)>"
    assert content.locator("strong").inner_text() == "bold"
    for tag in ("script", "img", "iframe", "a"):  # the javascript: link stays text
        expect(content.locator(tag)).to_have_count(0)
    assert reply.locator(".reasoning-text").text_content() == "Think <b>hard</b> first."
    expect(reply.locator(".reasoning b")).to_have_count(0)
    page.wait_for_timeout(200)
    assert dialogs == [] and page.errors == []
