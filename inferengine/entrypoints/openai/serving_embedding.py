"""`/v1/embeddings` (OpenAI's shape, vLLM's extras): inputs to pooled vectors on a pooling model."""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from inferengine.entrypoints.openai.serving_engine import OpenAIServing, ascii_name, random_id
from inferengine.entrypoints.openai.streaming import close_streams, merge_streams, start_streams
from inferengine.errors import InvalidRequestError
from inferengine.outputs import RequestOutput
from inferengine.pooling_params import (
    PoolerConfig,
    PoolingParams,
    check_task,
    pooling_sampling_params,
    resolve_pooling,
)

router = APIRouter()
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: int = 0


class EmbeddingData(BaseModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def as_token_lists(
    inputs: str | list[str] | list[int] | list[list[int]], tokenizer: Any, add_special: bool
) -> list[list[int]]:
    """Each input as token ids: a string, a list of strings, one list of ids, or lists of ids."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        raise InvalidRequestError("input is empty; send at least one input.", param="input")
    if all(isinstance(x, int) for x in inputs):
        return [list(inputs)]  # type: ignore[arg-type]
    return [
        tokenizer.encode(x, add_special_tokens=add_special) if isinstance(x, str) else list(x)
        for x in inputs
    ]


def truncate(ids: list[int], keep: int | None, max_model_len: int, index: int) -> list[int]:
    """The last `keep` tokens (-1: max_model_len); a longer input without it is a 400."""
    if keep is not None:
        keep = max_model_len if keep == -1 else keep
        if not 1 <= keep <= max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 or 1 to {max_model_len}; got {keep}.",
                param="truncate_prompt_tokens",
            )
        ids = ids[-keep:]
    if len(ids) > max_model_len:
        raise InvalidRequestError(
            f"input {index} has {len(ids)} tokens, more than this model's maximum context length "
            f"({max_model_len}); shorten it or set truncate_prompt_tokens.",
            param="input",
        )
    if not ids:
        raise InvalidRequestError(f"input {index} is empty (no tokens).", param="input")
    return ids


def embedding_inputs(
    req: EmbeddingRequest, pooler: PoolerConfig | None, tokenizer: Any, max_model_len: int
) -> tuple[list[list[int]], PoolingParams]:
    """The request's token lists and pooling, or the 400 that refuses it (shared with
    run-batch)."""
    if req.model_extra:
        name = sorted(req.model_extra)[0]
        raise InvalidRequestError(
            f"/v1/embeddings does not take {ascii_name(name)!r}.", param=ascii_name(name)
        )
    check_task(pooler, "embed")
    lists = as_token_lists(req.input, tokenizer, req.add_special_tokens)
    if len(lists) > MAX_INPUTS:
        raise InvalidRequestError(
            f"{len(lists)} inputs in one request; at most {MAX_INPUTS}.", param="input"
        )
    lists = [
        truncate(ids, req.truncate_prompt_tokens, max_model_len, i) for i, ids in enumerate(lists)
    ]
    params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    resolve_pooling(pooler, params)
    return lists, params


def embedding_response(
    request_id: str,
    req: EmbeddingRequest,
    lists: list[list[int]],
    outputs: list[RequestOutput],
    model_name: str,
) -> EmbeddingResponse:
    data = []
    for i, out in enumerate(outputs):
        if out.error is not None or out.pooled is None:
            raise InvalidRequestError(out.error or f"input {i} ended without an embedding.")
        vector: list[float] | str = (
            base64.b64encode(out.pooled).decode()
            if req.encoding_format == "base64"
            else out.embedding or []
        )
        data.append(EmbeddingData(index=i, embedding=vector))
    tokens = sum(len(ids) for ids in lists)
    return EmbeddingResponse(
        id=request_id,
        created=int(time.time()),
        model=model_name,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


class ServingPooling(OpenAIServing):
    """Prompt-only requests: one pooling request per input, batched by the scheduler."""

    async def pool(
        self, token_lists: list[list[int]], params: PoolingParams, priority: int, prefix: str
    ) -> tuple[str, list[RequestOutput]]:
        if len(token_lists) > min(MAX_INPUTS, self.limits.max_request_seqs):
            raise InvalidRequestError(
                f"{len(token_lists)} inputs in one request; at most "
                f"{min(MAX_INPUTS, self.limits.max_request_seqs)}.",
                param="input",
            )
        resolve_pooling(self.model_config.pooler, params)  # refused before anything is sent
        request_id = random_id(prefix)
        gens = [
            self.engine.generate(
                {"prompt_token_ids": ids},
                pooling_sampling_params(),
                f"{request_id}-{i}",
                priority=priority,
                pooling_params=params,
            )
            for i, ids in enumerate(token_lists)
        ]
        streams = await start_streams(gens)
        results: dict[int, RequestOutput] = {}
        try:
            async for index, output in merge_streams(streams):
                if output.error is not None:
                    raise InvalidRequestError(output.error)
                if output.finished:
                    results[index] = output
        finally:
            await close_streams(streams)
        return request_id, [results[i] for i in range(len(token_lists))]

    async def embeddings(self, req: EmbeddingRequest) -> EmbeddingResponse:
        self.check_model(req.model)
        pooler = self.model_config.pooler
        lists, params = embedding_inputs(req, pooler, self.tokenizer, self.max_model_len)
        request_id, outputs = await self.pool(lists, params, req.priority, "embd")
        return embedding_response(request_id, req, lists, outputs, self.model_name)


def pooling_handler(request: Request) -> ServingPooling:
    state = request.app.state.server
    state.check_serving()
    handler = getattr(state, "pooling_handler", None)
    if handler is None or handler.engine is not state.engine:
        handler = ServingPooling(state.engine, state.config.enable_log_requests)
        state.pooling_handler = handler
    return handler


@router.post("/v1/embeddings", response_model=None)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    result = await pooling_handler(request).embeddings(body)
    return Response(result.model_dump_json(), media_type="application/json")
