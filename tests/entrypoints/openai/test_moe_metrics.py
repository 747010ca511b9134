"""/metrics of a mixture-of-experts model: tokens per expert per layer, read from the engine's
device counters when scraped."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.server import SERVED_NAME, RemoteServer

NAME = "inferengine:moe_expert_tokens"


def _expert_tokens(server) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {
        (s.labels["layer"], s.labels["expert"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == NAME
        for s in family.samples
        if s.name == NAME + "_total"
    }


def test_metrics_count_tokens_per_expert_per_layer(tiny_checkpoint):
    server = RemoteServer(tiny_checkpoint("mixtral"), "--max-model-len", "256")
    try:
        server.wait_ready()
        before = _expert_tokens(server)
        with server.client() as c:
            prompt = "The quick brown fox jumps over the lazy dog."
            n_prompt = c.post("/tokenize", json={"prompt": prompt}).json()["count"]
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
            assert c.post("/v1/completions", json=body).status_code == 200
        after = _expert_tokens(server)
        assert {layer for layer, _ in after} == {"0", "1"}  # 2 sparse layers of 4 experts
        assert len(after) == 8
        # Every computed token (the prompt, then all generated tokens but the last) counts
        # once for each of its 2 experts.
        for layer in ("0", "1"):
            moved = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == layer)
            assert moved == 2 * (n_prompt + 4)
    finally:
        server.stop()
