"""Take the manual's screenshots of the web page (docs/images/web-*.png).

    python tests/entrypoints/web/screenshots.py [MODEL]

Serves MODEL (default: the default model, smollm2-135m-instruct) on the CPU with a small KV
cache, a CPU tier and n-gram speculation, has a real conversation in the chat (1440 px and
375 px wide), then runs a mixed load (shared prefixes, sessions, one JSON-schema request) and
shots the engine view while it runs. Needs Playwright and Debian's Chromium, like the tests.
The PNGs are palette-quantized to stay small.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from PIL import Image  # noqa: E402
from playwright.sync_api import expect, sync_playwright  # noqa: E402

from tests.entrypoints.openai.server import free_port  # noqa: E402
from tests.entrypoints.web.conftest import CHROMIUM, open_page  # noqa: E402

OUT = ROOT / "docs" / "images"
SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
SYSTEM = "You are a concise assistant. Answer in Markdown."
QUESTIONS = [
    "Write a Python function that reverses a string, in a code block.",
    "Explain how the slicing in it works, in three short bullet points.",
]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def serve(model: str, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "inferengine.entrypoints.cli.main", "serve", model]
    cmd += ["--port", str(port), "--kv-cache-memory", "48MiB", "--kv-offloading-size", "0.25"]
    cmd += ["--speculative-config", json.dumps(SPECULATION), "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited; see {log.name}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not start; see {log.name}")


def save(page, name: str, **kwargs) -> None:
    path = OUT / name
    page.screenshot(path=str(path), **kwargs)
    image = Image.open(path).convert("RGB").quantize(colors=256, method=Image.Quantize.MAXCOVERAGE)
    image.save(path, optimize=True)
    print(f"{path.relative_to(ROOT)}: {path.stat().st_size // 1024} kB")


def chat(page) -> None:
    page.fill("#system-prompt", SYSTEM)
    page.fill("#max-tokens", "120")
    for question in QUESTIONS:
        page.fill("#prompt", question)
        page.click("#send")
        expect(page.locator(".message.assistant .meta")).to_have_count(
            QUESTIONS.index(question) + 1, timeout=400_000
        )


def load(url: str, stop: threading.Event) -> list[threading.Thread]:
    """Clients that keep asking until `stop`: a shared system prompt (prefix hits), two
    sessions with a lease, and one JSON-schema request now and then."""

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            turn = 0
            while not stop.is_set():
                body = {
                    "messages": [
                        {"role": "system", "content": SYSTEM * 8},
                        {"role": "user", "content": f"Tell me fact number {turn} about {k}."},
                    ],
                    "max_tokens": 64,
                    "temperature": 0.8,
                }
                if k < 2:
                    body |= {"prompt_cache_key": f"agent-{k}", "prompt_cache_retention": "10m"}
                if k == 2 and turn % 2 == 0:
                    body["response_format"] = {
                        "type": "json_schema",
                        "json_schema": {"name": "city", "schema": SCHEMA},
                    }
                http.post("/v1/chat/completions", json=body)
                turn += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        proc, url = serve(model, log)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
            context, page, _ = open_page(browser, url + "/", key=None, width=1440, height=860)
            chat(page)
            save(page, "web-chat.png")
            narrow, phone, _ = open_page(browser, url + "/", key=None, width=375, height=760)
            phone.fill("#prompt", QUESTIONS[0])
            phone.click("#send")
            expect(phone.locator(".message.assistant .meta")).to_have_count(1, timeout=400_000)
            save(phone, "web-chat-375.png")
            narrow.close()
            stop = threading.Event()
            threads = load(url, stop)
            page.click("#tab-engine")
            page.wait_for_timeout(20_000)  # a score of points in each series
            # and the sessions' first requests ended (their leases start then)
            expect(page.locator("#sessions")).to_contain_text("agent-1", timeout=300_000)
            save(page, "web-engine.png", full_page=True)
            stop.set()
            context.close()
            browser.close()
        for t in threads:
            t.join(300)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
