"""Scores through the engine: a yes/no reranker (--convert classify, Qwen3-Reranker's recipe)
equals Transformers' softmax over the two tokens' logits at the last position, in order and
value; an embedding model scores pairs by the cosine of its vectors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from inferengine.entrypoints.llm import LLM
from inferengine.entrypoints.pooling_inputs import pair_up
from inferengine.errors import ConfigError, InvalidRequestError

QUERY = "Which city is the capital of France?"
DOCS = ["Paris is the capital of France.", "The quick brown fox", "Hello world, how are you today?"]


def reranker_folder(src, dst, token_ids=(40, 41)):
    """A copy of a tiny checkpoint whose config names two of its tokens as (no, yes)."""
    import transformers

    shutil.copytree(src, dst)
    tokens = transformers.AutoTokenizer.from_pretrained(src).convert_ids_to_tokens(list(token_ids))
    config = json.loads((dst / "config.json").read_text())
    config["classifier_from_token"] = tokens
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@torch.no_grad()
def hf_yes_probability(model, ids: list[int], token_ids=(40, 41)) -> float:
    logits = model(torch.tensor([ids])).logits[0, -1, list(token_ids)]
    return float(torch.softmax(logits.float(), dim=-1)[1])


def test_yes_no_reranker_equals_transformers(tiny_checkpoint, tmp_path):
    import transformers

    folder = reranker_folder(tiny_checkpoint("qwen3"), tmp_path / "reranker")
    llm = LLM(
        str(folder),
        runner="pooling",
        convert="classify",
        dtype="float32",
        max_num_batched_tokens=16,
    )
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    want = [
        hf_yes_probability(model, tok.encode(QUERY) + tok.encode(d, add_special_tokens=False))
        for d in DOCS
    ]
    got = [o.outputs.score for o in outs]
    assert got == pytest.approx(want, abs=1e-5)
    assert sorted(range(3), key=lambda i: -got[i]) == sorted(range(3), key=lambda i: -want[i])
    pairwise = llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]], use_tqdm=False)
    assert pairwise[0].outputs.score == pytest.approx(got[1], abs=1e-6)
    with pytest.raises(InvalidRequestError, match="score"):
        llm.embed("hello", use_tqdm=False)


def test_embedding_model_scores_by_cosine(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen2")), runner="pooling", dtype="float32")
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed([QUERY, *DOCS], use_tqdm=False)]
    want = [float(F.cosine_similarity(vectors[0], v, dim=0)) for v in vectors[1:]]
    assert scores == pytest.approx(want, abs=1e-5)


def test_pairing_and_refusals(tiny_checkpoint, tmp_path):
    assert pair_up("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["q1", "q2"], ["a", "b"]) == [("q1", "a"), ("q2", "b")]
    with pytest.raises(InvalidRequestError, match="pairwise"):
        pair_up(["q1", "q2"], ["a", "b", "c"])
    folder = reranker_folder(tiny_checkpoint("qwen3"), tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    config["classifier_from_token"] = ["not-a-token-here", "nor-this"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="single tokens"):
        LLM(str(folder), runner="pooling", convert="classify")
    generator = LLM(str(tiny_checkpoint("qwen3")), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="pooling model"):
        generator.score("a", "b", use_tqdm=False)
