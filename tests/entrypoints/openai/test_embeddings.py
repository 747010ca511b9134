"""`/v1/embeddings` over HTTP on a tiny Qwen3 served with `--runner pooling`: the vectors equal
Transformers' normalized last hidden state (float and base64), `dimensions` cuts them, usage
counts the tokens, and bad input (an empty list, too many inputs, an input over the context,
an unknown field, generation on an embedder, embeddings on a generator) is a 400."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.entrypoints.openai.server import SERVED_NAME, RemoteServer

MAX_LEN = 64


@pytest.fixture(scope="module")
def embed_server(tiny_checkpoint):
    server = RemoteServer(
        tiny_checkpoint("qwen3"),
        "--runner",
        "pooling",
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_LEN),
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    import transformers

    path = tiny_checkpoint("qwen3")
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)

    @torch.no_grad()
    def embed(ids: list[int]) -> torch.Tensor:
        return F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)

    return embed, tokenizer


def _post(server, body, path="/v1/embeddings"):
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60)


def test_embeddings_equal_transformers(embed_server, reference):
    embed, tokenizer = reference
    texts = ["Hello world", "a somewhat longer sentence to embed here, with more tokens in it"]
    r = _post(embed_server, {"model": SERVED_NAME, "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == SERVED_NAME
    ids = [tokenizer.encode(t) for t in texts]
    assert body["usage"] == {
        "prompt_tokens": sum(map(len, ids)),
        "total_tokens": sum(map(len, ids)),
    }
    for i, item in enumerate(body["data"]):
        assert item["index"] == i and item["object"] == "embedding"
        got = torch.tensor(item["embedding"])
        assert float(F.cosine_similarity(got, embed(ids[i]), dim=0)) >= 0.99999
    # Token ids (one list, and lists), base64 and a Matryoshka cut.
    one = _post(embed_server, {"input": ids[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, body["data"][0]["embedding"], atol=1e-6)
    cut = _post(embed_server, {"input": ids, "dimensions": 8}).json()["data"]
    raw = F.normalize(embed(ids[1]), dim=0)  # unit length; the cut is normalized again
    want = F.normalize(raw[:8], dim=0)
    assert len(cut[1]["embedding"]) == 8
    assert torch.allclose(torch.tensor(cut[1]["embedding"]), want, atol=1e-5)


def test_openai_client(embed_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key=embed_server.api_key)
    out = client.embeddings.create(model=SERVED_NAME, input=["one", "two", "three"])
    assert [d.index for d in out.data] == [0, 1, 2]
    assert all(abs(np.linalg.norm(d.embedding) - 1) < 1e-5 for d in out.data)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": []}, "empty"),
        ({"input": [[5]] * 2049}, "at most"),
        ({"input": list(range(5, 5 + MAX_LEN + 1))}, "truncate_prompt_tokens"),
        ({"input": "hi", "dimensions": 100000}, "dimensions"),
        ({"input": "hi", "pooling_kind": "max"}, "pooling_kind"),
        ({"input": "hi", "x" * 5000: 1}, "does not take"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_input_is_400(embed_server, body, says):
    r = _post(embed_server, body)
    assert r.status_code == 400, r.text
    assert says in r.text and len(r.content) <= 2048


def test_truncation_and_generation_refused(embed_server):
    long = list(range(5, 5 + MAX_LEN + 10))
    r = _post(embed_server, {"input": long, "truncate_prompt_tokens": 16})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16
    r = _post(embed_server, {"prompt": "hi", "max_tokens": 2}, "/v1/completions")
    assert r.status_code == 400 and "embedding" in r.text


def test_generating_model_refuses_embeddings(tiny_server):
    r = _post(tiny_server, {"input": "hi"})
    assert r.status_code == 400 and "pooling model" in r.text
