"""run-batch with OpenAI Batch rows for `/v1/embeddings` on a pooling model: each record's body
is what the server answers (vectors equal `LLM.embed`'s, base64 and `dimensions` included), a
bad row is its 400 record, and generation rows on the embedder are 400 records too."""

from __future__ import annotations

import base64

import numpy as np

from inferengine import LLM
from tests.entrypoints.batch.helpers import read_jsonl, run, write_jsonl


def _line(custom_id: str, body: dict, url: str = "/v1/embeddings") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_embedding_rows(tiny_checkpoint, tmp_path):
    llm = LLM(str(tiny_checkpoint("qwen3")), runner="pooling", dtype="float32", max_model_len=64)
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog"]
    rows = [
        _line("a", {"input": texts}),
        _line("b", {"input": texts[1], "encoding_format": "base64", "dimensions": 8}),
        _line("c", {"input": []}),
        _line("d", {"prompt": "hi", "max_tokens": 2}, "/v1/completions"),
    ]
    out = tmp_path / "out.jsonl"
    summary = run(llm, write_jsonl(tmp_path / "in.jsonl", rows), out)
    records = {r["custom_id"]: r for r in read_jsonl(out)}
    want = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    a = records["a"]["response"]
    assert a["status_code"] == 200 and records["a"]["error"] is None
    got = [d["embedding"] for d in a["body"]["data"]]
    assert np.allclose(got, want, atol=1e-6)
    assert a["body"]["usage"]["prompt_tokens"] == a["body"]["usage"]["total_tokens"] > 0
    b = records["b"]["response"]["body"]["data"][0]["embedding"]
    cut = np.frombuffer(base64.b64decode(b), dtype="<f4")
    head = np.asarray(want[1][:8])
    assert np.allclose(cut, head / np.linalg.norm(head), atol=1e-5)
    assert records["c"]["response"]["status_code"] == 400
    assert "empty" in records["c"]["error"]["message"]
    assert records["d"]["response"]["status_code"] == 400
    assert "embedding" in records["d"]["error"]["message"]
    assert summary.output_tokens == 0
