"""The Responses routes (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) and their
store, added to the app by `install`."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from inferengine.entrypoints.openai.config import ServerConfig
from inferengine.entrypoints.openai.responses.protocol import ResponsesRequest
from inferengine.entrypoints.openai.responses.serving import ServingResponses
from inferengine.entrypoints.openai.responses.store import ResponseStore
from inferengine.errors import InvalidRequestError

router = APIRouter()


def install(app: FastAPI, config: ServerConfig) -> None:
    """Serve the Responses API on `app`, its store bounded by `config`."""
    app.state.response_store = ResponseStore(
        config.responses_store_max, config.responses_store_bytes, config.responses_store_ttl
    )
    app.include_router(router)


def _serving(request: Request) -> ServingResponses:
    chat = request.app.state.server.serving().chat
    return ServingResponses(chat, request.app.state.response_store)


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    return await _serving(request).create(body, request)


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(response_id: str, request: Request) -> Response:
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise InvalidRequestError(
            "stream is not supported here: streaming a stored response again is for background "
            "responses, which this server does not run.",
            param="stream",
        )
    return JSONResponse(_serving(request).retrieve(response_id))


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> Response:
    return JSONResponse(_serving(request).delete(response_id))
