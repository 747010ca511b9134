"""Prompts to engine-core requests: tokenize, apply chat templates, validate, attach EOS."""

from __future__ import annotations

import time
from typing import Any

from inferengine.config import ModelConfig
from inferengine.core.engine_io import EngineCoreRequest
from inferengine.errors import InvalidRequestError
from inferengine.lora.checker import AdapterChecker, check_lora_request
from inferengine.lora.request import LoRARequest
from inferengine.pooling_params import PoolingParams, resolve_pooling
from inferengine.retention import Retention
from inferengine.sampling_params import SamplingParams

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    lora: AdapterChecker | None = None  # set by the engine front when LoRA is on

    def __init__(self, model_config: ModelConfig, tokenizer: Any, scheduling_policy: str = "fcfs"):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        gen = model_config.generation_config
        eos = gen.get("eos_token_id", model_config.hf_config.get("eos_token_id"))
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        if tokenizer_eos is not None and tokenizer_eos not in eos_ids:
            eos_ids.insert(0, tokenizer_eos)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self.extra_stop_token_ids = eos_ids[1:]

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer; send token ids.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}."
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer, so no chat template.")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "the model's tokenizer has no chat template; send a plain prompt to "
                "/v1/completions, or pass a chat template."
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **template_kwargs,
            )
        except Exception as e:
            raise InvalidRequestError(
                f"cannot apply the chat template to these messages: {e}"
            ) from e

    def chat_prompt(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        text = self.apply_chat_template(messages, **kwargs)
        # The template already holds BOS and other special tokens.
        return {
            "prompt": text,
            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
        }

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        if priority != 0 and self.scheduling_policy != "priority":
            # Under fcfs the scheduler never reads it: refuse it, as vLLM does.
            raise InvalidRequestError(
                f"priority {priority} needs priority scheduling, but this engine schedules "
                f"{self.scheduling_policy}; start it with --scheduling-policy priority.",
                param="priority",
            )
        n = len(prompt_token_ids)
        max_len = self.model_config.max_model_len
        vocab = self.model_config.vocab_size
        if n == 0:
            raise InvalidRequestError(
                "the prompt is empty; send at least one token.", param="prompt"
            )
        if n > max_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens, more than this model's maximum context length "
                f"({max_len}). Shorten the prompt, or start the engine with a larger "
                "--max-model-len.",
                param="prompt",
            )
        not_ids = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool)]
        if not_ids:
            raise InvalidRequestError(
                f"prompt token ids must be integers; got {type(not_ids[0]).__name__} "
                f"{not_ids[0]!r}. Pass the tokenizer's ids (a list of int), or the text as a "
                "prompt.",
                param="prompt",
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}).", param="prompt"
            )
        params.verify_vocab(vocab)

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        retention: Retention | None = None,
        kv_transfer_params: dict | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineCoreRequest:
        self.validate(prompt_token_ids, params, priority)
        if lora_request is not None:
            check_lora_request(self.lora, lora_request)
        pooling_params = resolve_pooling(self.model_config.pooler, pooling_params)
        if kv_transfer_params is not None and params.n > 1:
            raise InvalidRequestError(
                "kv_transfer_params (disaggregated prefill/decode) takes one sample: use n=1.",
                param="kv_transfer_params",
            )
        retention = retention or Retention()
        for num_tokens, _ in retention.breakpoints:
            if not 0 < num_tokens <= len(prompt_token_ids):
                raise InvalidRequestError(
                    f"a cache breakpoint covers {num_tokens} tokens of a "
                    f"{len(prompt_token_ids)}-token prompt; it must cover 1 to all of them."
                )
        if self.extra_stop_token_ids and not params.ignore_eos:
            params.extra_stop_token_ids = list(self.extra_stop_token_ids)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time or time.time(),
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
            cache_key=retention.key,
            cache_ttl_s=retention.ttl_s,
            cache_breakpoints=list(retention.breakpoints),
            kv_transfer_params=kv_transfer_params,
            pooling_params=pooling_params,
        )
