"""What the generating endpoints share: model check, length limits, sampling params, logprobs."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from inferengine.engine.async_llm import AsyncLLM
from inferengine.entrypoints.openai.protocol import (
    UNSUPPORTED_FIELDS,
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    UsageInfo,
    unsupported_reason,
)
from inferengine.entrypoints.openai.streaming import EngineStream, start_streams
from inferengine.entrypoints.openai.structured_outputs import structured_outputs
from inferengine.errors import InvalidRequestError, ModelNotFoundError, excerpt
from inferengine.logger import init_logger
from inferengine.lora.registry import LoRARegistry
from inferengine.lora.request import LoRARequest
from inferengine.outputs import PositionLogprobs, RequestOutput
from inferengine.retention import Retention
from inferengine.sampling_params import RequestOutputKind, SamplingParams, sampling_defaults

logger = init_logger(__name__)

MAX_LOGPROBS = 20
_LOGPROB_FLOOR = -9999.0  # JSON has no -inf
# What a request that leaves these unset gets, under the model's generation_config.json values
# (`sampling_defaults`, the same defaults `LLM` and `inferengine generate` use).
_BUILTIN_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one request may ask for, and on its log line (`ServerConfig`'s flags)."""

    max_n: int = 128  # OpenAI's limit
    max_request_seqs: int = 16384  # prompts x n
    max_log_len: int = 2048  # characters of parameters in a request's log line


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


# Characters that `str.splitlines` (and so some clients' line readers) takes for line breaks,
# written as JSON escapes so that a generated one never splits an event's line.
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x1c\x1d\x1e\x85\u2028\u2029"})


def sse(payload: Any) -> str:
    """One Server-Sent Event carrying a pydantic model, on one line whatever the text holds."""
    return f"data: {payload.model_dump_json().translate(_LINE_BREAKS)}\n\n"


def _floor(value: float) -> float:
    return max(value, _LOGPROB_FLOOR)


class OpenAIServing:
    loras: LoRARegistry | None = None  # the server's LoRA adapters by name, set at start

    def __init__(
        self, engine: AsyncLLM, log_requests: bool = False, limits: RequestLimits | None = None
    ):
        self.engine = engine
        self.model_config = engine.model_config
        self.model_name = engine.model_config.name
        self.max_model_len = engine.model_config.max_model_len
        self.tokenizer = engine.tokenizer
        self.log_requests = log_requests
        self.limits = limits or RequestLimits()
        self.defaults = sampling_defaults(engine.model_config.generation_config)
        # generation_config.json's max_new_tokens; None: each endpoint's own default
        self.default_max_tokens: int | None = self.defaults.pop("max_tokens", None)
        self._token_strs: dict[int, str] = {}

    # ---- checks ----------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and self.lora_for(name) is None:
            raise ModelNotFoundError(
                f"The model `{excerpt(name)}` does not exist; this server serves "
                f"`{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model."""
        return None if self.loras is None else self.loras.get(name)

    def resolve_max_tokens(
        self,
        requested: int | None,
        num_prompt: int,
        default: int | None,
        where: str,
        param: str = "max_tokens",
    ) -> int:
        """The output budget: the request's (its field: `param`), else `default` (None: the
        rest of the context)."""
        limit = self.max_model_len
        if requested is not None and requested < 1:
            raise InvalidRequestError(f"{param} must be at least 1, got {requested}.", param=param)
        if num_prompt >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_prompt} input tokens, which leaves no room for a completion. Please "
                f"reduce the length of the {where}.",
                param=where,
            )
        room = limit - num_prompt
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + requested} tokens ({num_prompt} in the {where}, {requested} in the "
                f"completion). Please reduce the length of the {where} or completion.",
                param=param,
            )
        return requested

    def check_fields(self, req: SamplingFields) -> None:
        """Refuse a field this server does not implement (400 naming it) and an `n` above the
        limit; warn of unknown ones (once per name)."""
        extra = req.model_extra or {}
        for name, value in extra.items():
            refuse_unsupported(name, value)
        if req.n > self.limits.max_n:
            raise InvalidRequestError(
                f"n must be at most {self.limits.max_n}, got {req.n}.", param="n"
            )
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            raise InvalidRequestError(
                "stream_options.continuous_usage_stats is not supported: usage comes in the last "
                "chunk with include_usage.",
                param="stream_options",
            )
        warn_unknown_fields(unknown_fields(req))

    # ---- parameters ------------------------------------------------------------------------

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int,
        kind: RequestOutputKind,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}.", param=name
                )
        if req.stream_options is not None and not req.stream:
            raise InvalidRequestError(
                "stream_options can only be set when stream is true.", param="stream_options"
            )
        picked = {
            name: value if (value := getattr(req, name)) is not None else default
            for name, default in (_BUILTIN_DEFAULTS | self.defaults).items()
        }
        return SamplingParams(
            n=req.n,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=_logit_bias(req.logit_bias),
            output_kind=kind,
            structured_outputs=structured_outputs(req),
            **picked,
        )

    @staticmethod
    def retention(req: SamplingFields) -> Retention:
        """The request's `prompt_cache_key` and `prompt_cache_retention`, checked."""
        return Retention.parse(req.prompt_cache_key, req.prompt_cache_retention)

    # ---- engine streams --------------------------------------------------------------------

    async def start(
        self,
        request_id: str,
        prompts: Sequence[dict[str, Any]],
        params: Sequence[SamplingParams],
        req: SamplingFields,
        retention: Retention | None = None,
    ) -> list[EngineStream]:
        """Submit one engine request per prompt, all with `retention`; refused requests raise
        before anything is sent. Logs one line for the whole request when request logging is on."""
        if self.log_requests:
            num_tokens = sum(len(prompt["prompt_token_ids"]) for prompt in prompts)
            logger.info(
                "request %s: %d prompt(s), %d prompt tokens, %s",
                request_id,
                len(prompts),
                num_tokens,
                _cut(_describe(params[0]), self.limits.max_log_len),
            )
        gens: list[AsyncGenerator[RequestOutput, None]] = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            gens.append(
                self.engine.generate(
                    prompt,
                    p,
                    sub_id,
                    priority=req.priority,
                    cache_salt=req.cache_salt,
                    retention=retention,
                    kv_transfer_params=req.kv_transfer_params,
                    lora_request=self.lora_for(getattr(req, "model", None)),
                )
            )
        return await start_streams(gens)

    # ---- tokens and logprobs ---------------------------------------------------------------

    def token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._token_strs) < 1_000_000:
                self._token_strs[token_id] = text
        return text

    def completion_logprobs(
        self,
        token_ids: Sequence[int],
        positions: Sequence[PositionLogprobs | None],
        text_offset: int,
    ) -> CompletionLogprobs:
        """The legacy completions shape; a position without logprobs (first prompt token) is null."""
        out = CompletionLogprobs()
        for token_id, position in zip(token_ids, positions, strict=True):
            token = self.token_str(token_id)
            chosen = position.get(token_id) if position is not None else None
            out.tokens.append(token)
            out.text_offset.append(text_offset)
            text_offset += len(token)
            if position is None or chosen is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_floor(chosen.logprob))
            out.top_logprobs.append(
                {
                    self._decoded(tid, lp.decoded_token): _floor(lp.logprob)
                    for tid, lp in position.items()
                }
            )
        return out

    def chat_logprobs(
        self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs], num_top: int
    ) -> ChatLogprobs:
        content = []
        for token_id, position in zip(token_ids, positions, strict=True):
            chosen = position.get(token_id)
            token = self.token_str(token_id)
            top = sorted(
                (
                    (lp.rank, tid, lp)
                    for tid, lp in position.items()
                    if lp.rank is not None and lp.rank <= num_top
                ),
                key=lambda item: item[0],
            )[:num_top]
            content.append(
                ChatLogprobToken(
                    token=token,
                    logprob=_floor(chosen.logprob) if chosen is not None else _LOGPROB_FLOOR,
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(
                            token=(s := self._decoded(tid, lp.decoded_token)),
                            logprob=_floor(lp.logprob),
                            bytes=list(s.encode("utf-8")),
                        )
                        for _, tid, lp in top
                    ],
                )
            )
        return ChatLogprobs(content=content)

    def _decoded(self, token_id: int, decoded: str | None) -> str:
        return decoded if decoded is not None else self.token_str(token_id)


def unknown_fields(req: SamplingFields) -> list[str]:
    """The request's fields that this server neither implements nor refuses: ignored, as vLLM
    does, with a warning and the `X-Unknown-Fields` response header."""
    return sorted(name for name in req.model_extra or {} if name not in UNSUPPORTED_FIELDS)


# Clients choose the names: the set of those warned about is kept as their short escaped forms
# (`ascii_name`), bounded in count and in characters, and so is each warning.
_warned_fields: set[str] = set()
_MAX_WARNED_FIELDS = 1024
_MAX_WARNED_CHARS = 64 * 1024
_warned_chars = 0


def warn_unknown_fields(names: Iterable[str], what: str = "request field(s) ignored") -> None:
    """Log `names` not logged before in this process, in one warning."""
    global _warned_chars
    new: list[str] = []
    for name in names:
        short = ascii_name(name)
        if short in _warned_fields or short in new:
            continue
        if len(_warned_fields) + len(new) >= _MAX_WARNED_FIELDS:
            break
        if _warned_chars + len(short) > _MAX_WARNED_CHARS:
            break
        new.append(short)
        _warned_chars += len(short)
    if not new:
        return
    _warned_fields.update(new)
    listed = _cut(", ".join(new), 1024)
    logger.warning("unknown %s: %s (each name is logged once)", what, listed)


def ascii_name(name: str, limit: int = 64) -> str:
    """A client-chosen field name, safe in a log line or an HTTP header: escaped, cut."""
    return _cut(name.encode("unicode_escape").decode("ascii"), limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more chars]"


def refuse_unsupported(name: str, value: Any) -> None:
    """A 400 naming field `name` when its value asks for something this server does not do."""
    reason = unsupported_reason(name, value)
    if reason is not None:
        raise InvalidRequestError(f"{name} is not supported: {reason}.", param=name)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except ValueError as e:
        raise InvalidRequestError(
            "logit_bias keys must be token ids (integers as strings).", param="logit_bias"
        ) from e


def _describe(p: SamplingParams) -> str:
    structured = p.structured_outputs.kind if p.structured_outputs is not None else None
    return (
        f"n={p.n} max_tokens={p.max_tokens} temperature={p.temperature} top_p={p.top_p} "
        f"top_k={p.top_k} seed={p.seed} stop={p.stop} logprobs={p.logprobs} "
        f"structured_outputs={structured}"
    )
