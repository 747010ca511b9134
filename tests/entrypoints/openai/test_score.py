"""`/v1/score` and `/v1/rerank` over HTTP on a tiny yes/no reranker (`--convert classify`):
scores equal Transformers' P(yes), rerank orders them, cuts to `top_n` and returns documents
only when asked; bad requests are 400s."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.entrypoints.openai.server import SERVED_NAME, RemoteServer
from tests.model.test_pooling_score import DOCS, QUERY, hf_yes_probability, reranker_folder


@pytest.fixture(scope="module")
def rerank_setup(tiny_checkpoint, tmp_path_factory):
    import transformers

    folder = reranker_folder(tiny_checkpoint("qwen3"), tmp_path_factory.mktemp("rr") / "m")
    server = RemoteServer(
        folder, "--runner", "pooling", "--convert", "classify", "--dtype", "float32"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    want = [
        hf_yes_probability(model, tok.encode(QUERY) + tok.encode(d, add_special_tokens=False))
        for d in DOCS
    ]
    try:
        yield server.wait_ready(), want
    finally:
        server.stop()


def _post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60)


def test_score_and_rerank_equal_transformers(rerank_setup):
    server, want = rerank_setup
    r = _post(server, "/v1/score", {"model": SERVED_NAME, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    assert body["usage"]["prompt_tokens"] > 0
    r = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in results] == order
    assert [x["relevance_score"] for x in results] == pytest.approx(
        [want[i] for i in order], abs=1e-5
    )
    assert results[0]["document"]["text"] == DOCS[order[0]]
    bare = _post(
        server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False}
    )
    assert (
        all("document" not in x for x in bare.json()["results"])
        and len(bare.json()["results"]) == 3
    )


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "pairwise"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "normalize": True}, "normalize"),
        ("/v1/embeddings", {"input": "a"}, "/v1/score"),
    ],
)
def test_bad_requests_are_400(rerank_setup, path, body, says):
    r = _post(rerank_setup[0], path, body)
    assert r.status_code == 400, r.text
    assert says in r.text
