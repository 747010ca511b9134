"""Score and rerank inputs shared by `LLM.score` and `/v1/score`, `/v1/rerank`: pairing, the
token ids of a (query, document) pair, and the cosine of two embeddings."""

from __future__ import annotations

import array
import math
from typing import Any

from inferengine.errors import InvalidRequestError


def pair_up(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one query against N documents, or N queries against N documents."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise InvalidRequestError("nothing to score: both sides need at least one text.")
    if len(first) == 1:
        return [(first[0], doc) for doc in second]
    if len(first) != len(second):
        raise InvalidRequestError(
            f"{len(first)} queries and {len(second)} documents: send one query, or as many "
            "queries as documents (scored pairwise)."
        )
    return list(zip(first, second, strict=True))


def pair_ids(tokenizer: Any, query: str, document: str, encoder: bool = False) -> list[int]:
    """A reranker's prompt. An encoder's is the tokenizer's text pair (XLM-R: <s> q </s></s>
    d </s>); a decoder's is the query (with the tokenizer's special tokens), then the
    document (without), its own template, if any, being part of the texts."""
    if encoder:
        return list(tokenizer(query, document)["input_ids"])
    return tokenizer.encode(query) + tokenizer.encode(document, add_special_tokens=False)


def cosine(a: bytes, b: bytes) -> float:
    """Cosine similarity of two float32 vectors."""
    x, y = array.array("f", a), array.array("f", b)
    dot = sum(p * q for p, q in zip(x, y, strict=True))
    norm = math.sqrt(sum(p * p for p in x)) * math.sqrt(sum(q * q for q in y))
    return dot / norm if norm else 0.0


def first_float(pooled: bytes) -> float:
    """A yes/no scorer's vector is [P(yes)]."""
    return float(array.array("f", pooled)[0])
