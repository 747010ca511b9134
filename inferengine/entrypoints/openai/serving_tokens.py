"""Token-level endpoints: `/tokenize`, `/detokenize` and the native `/v1/generate`."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response

from inferengine.entrypoints.chat_messages import templated_prompt
from inferengine.entrypoints.openai.errors import stream_error_event
from inferengine.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from inferengine.entrypoints.openai.serving_chat import chat_template_kwargs, message_dicts
from inferengine.entrypoints.openai.serving_engine import (
    OpenAIServing,
    make_usage,
    random_id,
    sse,
)
from inferengine.entrypoints.openai.streaming import (
    SSE_DONE,
    EngineStream,
    SSEResponse,
    close_streams,
    unless_disconnected,
)
from inferengine.entrypoints.openai.tools import check_tool_list
from inferengine.errors import InvalidRequestError
from inferengine.outputs import CompletionOutput
from inferengine.sampling_params import RequestOutputKind


class ServingTokens(OpenAIServing):
    # ---- tokenize / detokenize -------------------------------------------------------------

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("send exactly one of prompt or messages.", param="prompt")
        if req.messages is not None:
            messages, _ = message_dicts(req.messages)  # cache_control marks change no token
            kwargs = chat_template_kwargs(req)
            if req.tools:
                check_tool_list(req.tools)
                kwargs["tools"] = req.tools
            prompt = templated_prompt(self.engine.input_processor, messages, **kwargs)
            ids = prompt["prompt_token_ids"]
        else:
            assert req.prompt is not None
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(
            tokens=ids, count=len(ids), max_model_len=self.max_model_len, token_strs=strs
        )

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = len(self.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab}).", param="tokens"
            )
        text = self.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
        return DetokenizeResponse(prompt=text)

    # ---- generate --------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest, raw: Request) -> Response | GenerateResponse:
        self.check_model(req.model)
        self.check_fields(req)
        if (req.prompt is None) == (req.prompt_token_ids is None):
            raise InvalidRequestError(
                "send exactly one of prompt or prompt_token_ids.", param="prompt"
            )
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        else:
            assert req.prompt is not None
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        max_tokens = self.resolve_max_tokens(
            req.max_tokens, len(ids), self.default_max_tokens or 16, "prompt"
        )
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = self.sampling_params(req, max_tokens, kind, logprobs=req.logprobs)
        request_id = random_id("gen")
        prompt = {"prompt": req.prompt, "prompt_token_ids": ids}
        stream = (await self.start(request_id, [prompt], [params], req, self.retention(req)))[0]
        if req.stream:
            return SSEResponse(self._stream(request_id, req, ids, stream))
        return await unless_disconnected(raw, self._full(request_id, ids, stream))

    @staticmethod
    def _choice(c: CompletionOutput) -> GenerateChoice:
        logprobs = None
        if c.logprobs is not None:
            logprobs = [
                {str(tid): lp.logprob for tid, lp in position.items()} for position in c.logprobs
            ]
        return GenerateChoice(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    async def _full(
        self, request_id: str, ids: list[int], stream: EngineStream
    ) -> GenerateResponse:
        final = None
        try:
            async for output in stream:
                final = output
        finally:
            await stream.aclose()
        assert final is not None
        if final.error:
            raise InvalidRequestError(final.error)
        outputs = sorted(final.outputs, key=lambda c: c.index)
        return GenerateResponse(
            id=request_id,
            model=self.model_name,
            prompt_token_ids=ids,
            choices=[self._choice(c) for c in outputs],
            usage=make_usage(
                len(ids), sum(len(c.token_ids) for c in outputs), final.num_cached_tokens
            ),
        )

    async def _stream(
        self, request_id: str, req: GenerateRequest, ids: list[int], stream: EngineStream
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        generated = cached = 0
        try:
            async for output in stream:
                if output.error:
                    raise InvalidRequestError(output.error)
                choices = [self._choice(c) for c in output.outputs]
                generated += sum(len(c.token_ids) for c in output.outputs)
                if output.finished:
                    cached = output.num_cached_tokens
                yield sse(
                    GenerateResponse(
                        id=request_id, created=created, model=self.model_name, choices=choices
                    )
                )
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = make_usage(len(ids), generated, cached)
                last = GenerateResponse(
                    id=request_id, created=created, model=self.model_name, choices=[], usage=usage
                )
                yield sse(last)
        except Exception as e:
            yield stream_error_event(e)
        finally:
            await close_streams([stream])
        yield SSE_DONE
