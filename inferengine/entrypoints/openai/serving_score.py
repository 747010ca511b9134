"""`/v1/score` (vLLM's text_1/text_2) and `/v1/rerank` (Jina/Cohere's query/documents/top_n):
a reranker's P(yes) per pair (--convert classify) or the cosine of an embedder's vectors."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from inferengine.entrypoints.openai.serving_embedding import (
    EmbeddingUsage,
    ServingPooling,
    pooling_handler,
    truncate,
)
from inferengine.entrypoints.openai.serving_engine import ascii_name
from inferengine.entrypoints.pooling_inputs import cosine, first_float, pair_ids, pair_up
from inferengine.errors import InvalidRequestError
from inferengine.pooling_params import PoolingParams, resolve_pooling

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class ScoreRequest(_Strict):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankRequest(_Strict):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


def _refuse_extra(req: BaseModel, route: str) -> None:
    if req.model_extra:
        name = sorted(req.model_extra)[0]
        raise InvalidRequestError(
            f"{route} does not take {ascii_name(name)!r}.", param=ascii_name(name)
        )


async def score_pairs(
    serving: ServingPooling,
    pairs: list[tuple[str, str]],
    keep: int | None,
    priority: int,
) -> tuple[str, list[float], int]:
    """(request id, one score per pair, prompt tokens run)."""
    pooler = serving.model_config.pooler
    resolve_pooling(pooler, PoolingParams())  # a generating model is a 400 here
    assert pooler is not None
    tok, max_len = serving.tokenizer, serving.max_model_len
    if pooler.task == "classify":
        lists = [
            truncate(pair_ids(tok, q, d, pooler.bidirectional), keep, max_len, i)
            for i, (q, d) in enumerate(pairs)
        ]
        request_id, outs = await serving.pool(lists, PoolingParams(), priority, "score")
        scores = [first_float(o.pooled or b"") for o in outs]
        return request_id, scores, sum(map(len, lists))
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    lists = [truncate(tok.encode(t), keep, max_len, i) for i, t in enumerate(texts)]
    request_id, outs = await serving.pool(lists, PoolingParams(), priority, "score")
    vectors = {t: o.pooled or b"" for t, o in zip(texts, outs, strict=True)}
    scores = [cosine(vectors[q], vectors[d]) for q, d in pairs]
    return request_id, scores, sum(map(len, lists))


@router.post("/v1/score", response_model=None)
async def score(body: ScoreRequest, request: Request) -> Response:
    serving = pooling_handler(request)
    serving.check_model(body.model)
    _refuse_extra(body, "/v1/score")
    pairs = pair_up(body.text_1, body.text_2)
    request_id, scores, tokens = await score_pairs(
        serving, pairs, body.truncate_prompt_tokens, body.priority
    )
    result = ScoreResponse(
        id=request_id,
        created=int(time.time()),
        model=serving.model_name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return Response(result.model_dump_json(), media_type="application/json")


@router.post("/v1/rerank", response_model=None)
async def rerank(body: RerankRequest, request: Request) -> Response:
    serving = pooling_handler(request)
    serving.check_model(body.model)
    _refuse_extra(body, "/v1/rerank")
    if not body.documents:
        raise InvalidRequestError("documents is empty; send at least one.", param="documents")
    if body.top_n is not None and body.top_n < 1:
        raise InvalidRequestError(f"top_n must be at least 1; got {body.top_n}.", param="top_n")
    pairs = [(body.query, doc) for doc in body.documents]
    request_id, scores, tokens = await score_pairs(
        serving, pairs, body.truncate_prompt_tokens, body.priority
    )
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
        )
        for i in order
    ]
    reply = RerankResponse(
        id=request_id,
        model=serving.model_name,
        results=results,
        usage=RerankUsage(total_tokens=tokens),
    )
    return Response(reply.model_dump_json(exclude_none=True), media_type="application/json")
