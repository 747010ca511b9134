"""Rows to engine requests and results to records, through the OpenAI server's own request mapping.

An OpenAI Batch row's `body` is validated as the server's `CompletionRequest` or
`ChatCompletionRequest` and turned into prompts and `SamplingParams` by the server's `prepare`; the
reply body is the server's `response`. A plain row (JSONL object, CSV row, Parquet row) becomes a
body of its known columns (`prompt` or `messages`, plus sampling fields); other columns pass through.
Unknown fields follow the server's policy: ignored with a warning that names each once.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from inferengine.config import ModelConfig
from inferengine.engine.input_processor import InputProcessor
from inferengine.engine.llm_engine import LLMEngine
from inferengine.entrypoints.batch.formats import OUTPUT_COLUMNS, InputRow
from inferengine.entrypoints.batch.resume import missing, row_key
from inferengine.entrypoints.openai.errors import error_body, internal_message, validation_message
from inferengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from inferengine.entrypoints.openai.serving_chat import ServingChat
from inferengine.entrypoints.openai.serving_completions import Prompt, ServingCompletion
from inferengine.entrypoints.openai.serving_embedding import (
    EmbeddingRequest,
    embedding_inputs,
    embedding_response,
)
from inferengine.entrypoints.openai.serving_engine import random_id, warn_unknown_fields
from inferengine.errors import ConfigError, InferEngineError, InvalidRequestError
from inferengine.pooling_params import PoolingParams, pooling_sampling_params
from inferengine.retention import Retention
from inferengine.sampling_params import SamplingParams

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
EMBEDDINGS_URL = "/v1/embeddings"  # OpenAI Batch rows only, on a pooling model
_LINE_FIELDS = ("custom_id", "method", "url", "body")
_NOT_IN_BATCH = ("stream", "stream_options")
# Fields that hold lists or objects: a string cell holding JSON is decoded (CSV has only strings).
_JSON_FIELDS = (
    "messages",
    "stop_token_ids",
    "logit_bias",
    "chat_template_kwargs",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_choice",
    "tools",
)
_FIELDS = {
    COMPLETIONS_URL: set(CompletionRequest.model_fields) - set(_NOT_IN_BATCH),
    CHAT_URL: set(ChatCompletionRequest.model_fields) - set(_NOT_IN_BATCH),
    EMBEDDINGS_URL: set(EmbeddingRequest.model_fields),
}


class RowError(InvalidRequestError):
    """A row that is not a request at all (bad JSON, unknown field, wrong url)."""


@dataclass(slots=True)
class _EngineView:
    """What the OpenAI serving classes read from an engine, taken from an `LLMEngine`."""

    model_config: ModelConfig
    tokenizer: Any
    input_processor: InputProcessor


@dataclass(slots=True)
class Job:
    """One row in the engine: one engine request per prompt (a completion body may have several)."""

    row: InputRow
    req: CompletionRequest | ChatCompletionRequest | EmbeddingRequest
    request_id: str
    prompts: list[Any]  # completions: `Prompt`s; chat: one engine input dict
    params: list[SamplingParams]
    retention: Retention
    reader: Any = None  # chat: how to read the reply (`ReplyReader`)
    remaining: int = 0  # engine requests not finished yet
    finals: list[Any] = field(default_factory=list)  # each prompt's final RequestOutput
    pooling: PoolingParams | None = None  # embeddings rows

    def engine_inputs(self) -> list[dict[str, Any]]:
        return [p.engine_input() if isinstance(p, Prompt) else p for p in self.prompts]


class RowMapper:
    def __init__(self, engine: LLMEngine, fmt: str, defaults: dict[str, Any] | None = None):
        view = _EngineView(engine.config.model_config, engine.tokenizer, engine.input_processor)
        self.model_config, self.tokenizer = view.model_config, view.tokenizer
        self.model_name = view.model_config.name
        self.completions = ServingCompletion(view, log_requests=False)  # type: ignore[arg-type]
        self.chat = ServingChat(view, log_requests=False)  # type: ignore[arg-type]
        self.fmt = fmt
        self.defaults = dict(defaults or {})
        unknown = set(self.defaults) - _FIELDS[COMPLETIONS_URL] - _FIELDS[CHAT_URL]
        if unknown:
            raise ConfigError(f"--defaults names unknown request fields: {sorted(unknown)}.")
        if self.defaults and fmt == "openai":
            raise ConfigError("--defaults is for plain rows; an OpenAI Batch body is complete.")

    # ---- identity --------------------------------------------------------------------------

    def custom_id(self, row: InputRow) -> Any:
        value = (row.data or {}).get("custom_id")
        if self.fmt == "openai" and not isinstance(value, str):
            return None
        return None if missing(value) else value

    def key(self, row: InputRow) -> str:
        return row_key(self.custom_id(row), row.index)

    # ---- rows to requests ------------------------------------------------------------------

    def prepare(self, row: InputRow) -> Job:
        """Raises `InferEngineError` or pydantic's `ValidationError` for a bad row."""
        if row.data is None:
            raise RowError(row.read_error or f"row {row.index} could not be read.")
        if self.fmt == "openai":
            url, body = _openai_body(row.data)
        else:
            url, body = self._plain_body(row.data)
        if url == EMBEDDINGS_URL:
            return self._embedding_job(row, body)
        if url == COMPLETIONS_URL:
            req = CompletionRequest.model_validate(body)
            prompts, params, retention = self.completions.prepare(req)
            if self.fmt != "openai" and (len(prompts) != 1 or req.n != 1):
                raise RowError("a plain row takes one prompt and n = 1; use the OpenAI format.")
            job = Job(row, req, random_id("cmpl"), prompts, params, retention)
        else:
            req = ChatCompletionRequest.model_validate(body)
            prompt, sampling, reader, retention = self.chat.prepare(req)
            if self.fmt != "openai" and req.n != 1:
                raise RowError("a plain row takes n = 1; use the OpenAI format.")
            job = Job(row, req, random_id("chatcmpl"), [prompt], [sampling], retention)
            job.reader = reader
        job.finals = [None] * len(job.prompts)
        return job

    def _embedding_job(self, row: InputRow, body: dict[str, Any]) -> Job:
        req = EmbeddingRequest.model_validate(body)
        mc = self.model_config
        lists, pooling = embedding_inputs(req, mc.pooler, self.tokenizer, mc.max_model_len)
        prompts = [{"prompt_token_ids": ids} for ids in lists]
        params = [pooling_sampling_params() for _ in lists]
        job = Job(row, req, random_id("embd"), prompts, params, Retention(), pooling=pooling)
        job.finals = [None] * len(prompts)
        return job

    def _plain_body(self, data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        clash = [k for k in OUTPUT_COLUMNS if k in data]
        if clash:
            raise RowError(
                f"the row has the field(s) {clash}, which run-batch writes; rename them."
            )
        values = {k: _decode(k, v, self.fmt) for k, v in data.items() if not missing(v)}
        if ("prompt" in values) == ("messages" in values):
            raise RowError("a row needs exactly one of a `prompt` or a `messages` column.")
        url = CHAT_URL if "messages" in values else COMPLETIONS_URL
        known = _FIELDS[url]
        warn_unknown_fields(
            (k for k in values if k not in known and k != "custom_id"),
            "column(s) passed through, not sent to the model",
        )
        body = {k: v for k, v in self.defaults.items() if k in known}
        body.update({k: v for k, v in values.items() if k in known})
        return url, body

    # ---- results to records ----------------------------------------------------------------

    def success(self, job: Job) -> dict[str, Any]:
        """The record of a finished job; raises when the engine failed a request (as the server
        does)."""
        body: CompletionResponse | ChatCompletionResponse
        if isinstance(job.req, EmbeddingRequest):
            lists = [p["prompt_token_ids"] for p in job.prompts]
            reply = embedding_response(job.request_id, job.req, lists, job.finals, self.model_name)
            response = {
                "status_code": 200,
                "request_id": job.request_id,
                "body": reply.model_dump(),
            }
            return self._openai_record(job.row, response, None)
        if isinstance(job.req, CompletionRequest):
            body = self.completions.response(job.request_id, job.req, job.prompts, job.finals)
            text = body.choices[0].text
        else:
            num_prompt = len(job.prompts[0]["prompt_token_ids"])
            body = self.chat.response(job.request_id, num_prompt, job.reader, job.finals[0])
            text = body.choices[0].message.content
        usage = body.usage
        assert usage is not None
        if self.fmt == "openai":
            response = {
                "status_code": 200,
                "request_id": job.request_id,
                "body": body.model_dump(mode="json"),
            }
            return self._openai_record(job.row, response, None)
        record = {
            **(job.row.data or {}),
            "row_index": job.row.index,
            "output_text": text,
            "finish_reason": body.choices[0].finish_reason,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "error": None,
        }
        return record

    def failure(self, row: InputRow, exc: Exception) -> dict[str, Any]:
        status, body = _error(exc)
        message = body["error"]["message"]
        if self.fmt == "openai":
            response = None
            if not isinstance(exc, RowError):  # the server would have answered with this error
                response = {"status_code": status, "request_id": random_id("batch"), "body": body}
            error = {"code": body["error"]["type"], "message": message}
            return self._openai_record(row, response, error)
        record = dict(row.data or {})
        record.update(dict.fromkeys(OUTPUT_COLUMNS))
        record.update(row_index=row.index, error=message)
        return record

    def _openai_record(
        self, row: InputRow, response: dict[str, Any] | None, error: dict[str, Any] | None
    ) -> dict[str, Any]:
        custom_id = (row.data or {}).get("custom_id")
        record = {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": response,
            "error": error,
        }
        if not isinstance(custom_id, str):
            record["row_index"] = row.index  # the row's identity for resuming
        return record


def _openai_body(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    warn_unknown_fields((k for k in data if k not in _LINE_FIELDS), "request line field(s) ignored")
    if not isinstance(data.get("custom_id"), str):
        raise RowError("each request line needs a string `custom_id`.")
    if data.get("method", "POST") != "POST":
        raise RowError(f"method must be POST, got {data.get('method')!r}.")
    url = data.get("url")
    if url not in _FIELDS:
        raise RowError(
            f"url {url!r} is not supported; use {COMPLETIONS_URL}, {CHAT_URL} or {EMBEDDINGS_URL}."
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise RowError("`body` must be a JSON object: the request the url would receive.")
    if body.get("stream"):
        raise RowError("stream is not supported in a batch file; remove it.")
    return url, {k: v for k, v in body.items() if k not in _NOT_IN_BATCH}


def _decode(name: str, value: Any, fmt: str) -> Any:
    """A JSON-encoded cell for a list or object field; in CSV also `stop` written as a JSON list."""
    if not isinstance(value, str):
        return value
    text = value.lstrip()
    structured = name in _JSON_FIELDS or (name == "stop" and fmt == "csv")
    if structured and text[:1] in ("[", "{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise RowError(f"column {name!r} holds invalid JSON: {e}") from e
    return value


def _error(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body the server would answer with."""
    if isinstance(exc, ValidationError):
        message, param = validation_message(exc)
        return 400, error_body(message, "invalid_request_error", 400, param)
    if isinstance(exc, InferEngineError):
        body = error_body(exc.message, exc.error_type, exc.status_code, exc.param, exc.code)
        return exc.status_code, body
    return 500, error_body(internal_message(exc), "internal_error", 500)
