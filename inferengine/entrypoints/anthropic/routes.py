"""The Messages routes, served by the running server's chat handler (`ServingMessages`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from inferengine.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from inferengine.entrypoints.anthropic.serving import ServingMessages

router = APIRouter()


def _serving(request: Request) -> ServingMessages:
    return ServingMessages(request.app.state.server.serving().chat)


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    return await _serving(request).create(body, request)


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    return _serving(request).count_tokens(body)
