"""`SamplingParams`: how one request is decoded, validated once when the request is made; its
`StructuredOutputsParams`."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from inferengine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5


# generation_config.json keys that become request defaults, as vLLM's
# `ModelConfig.get_diff_sampling_param`; Transformers' `max_new_tokens` is our `max_tokens`.
GENERATION_CONFIG_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The `SamplingParams` fields a generation_config.json sets, for requests that leave them
    unset (`do_sample` is ignored, as vLLM does)."""
    return {
        ("max_tokens" if k == "max_new_tokens" else k): generation_config[k]
        for k in GENERATION_CONFIG_SAMPLING_KEYS
        if generation_config.get(k) is not None
    }


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries all text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output when the request finishes


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's `structured_outputs` (one of json, regex, choice, grammar, json_object), carried
    by `SamplingParams` and checked when the request is made."""

    json: str | dict[str, Any] | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF/EBNF (llama.cpp's, vLLM's grammar field)
    json_object: bool = False  # any JSON object
    # JSON without whitespace between tokens (vLLM's disable-any-whitespace), always on here:
    # a weak model cannot spend its token budget on spaces.
    disable_any_whitespace: bool = True
    # Reasoning models (set by `--reasoning-parser`, not by clients): the grammar starts after
    # the token that ends the reasoning block (`</think>`), unless the prompt already closed the
    # block (its last end token after its last start token, as a template with thinking off).
    reasoning_start_token_id: int | None = None
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured output takes exactly one of json, regex, choice, grammar or "
                f"json_object; got {', '.join(given) or 'none'}.",
                param="structured_outputs",
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(
                "structured output choice must be a non-empty list of non-empty strings.",
                param="structured_outputs.choice",
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(
                    f"the JSON schema is not valid JSON: {e}.", param="structured_outputs.json"
                ) from None
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise InvalidRequestError(
                "a JSON schema must be a JSON object.", param="structured_outputs.json"
            )

    def reasoning_ended_in(self, prompt_token_ids: list[int]) -> bool:
        """Whether the grammar applies from the first output token of this prompt."""
        end = self.reasoning_end_token_id
        if end is None:
            return True
        last_end = _last_index(prompt_token_ids, end)
        last_start = _last_index(prompt_token_ids, self.reasoning_start_token_id)
        return last_end > last_start

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What the grammar depends on (a cache key; a schema keeps its property order, which
        the output follows)."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value)
        return self.kind, text


def _last_index(token_ids: list[int], token_id: int | None) -> int:
    if token_id is None:
        return -1
    for i in range(len(token_ids) - 1, -1, -1):
        if token_ids[i] == token_id:
            return i
    return -1


@dataclass
class SamplingParams:
    """Mirrors vLLM's `SamplingParams`; fields keep vLLM's names and defaults."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    # Accepted for vLLM compatibility, no effect: text is what the tokenizer's decoder writes.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: stop token ids from the model's generation config (besides EOS).
    extra_stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, f"{name} must be a finite number, got {getattr(self, name)}.")
        if self.n < 1:
            raise bad("n", f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"{name} must be in [-2, 2], got {value}.")
        if self.repetition_penalty <= 0.0:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}.",
            )
        if self.temperature < 0.0:
            raise bad("temperature", f"temperature must be 0 or more, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise bad("top_k", f"top_k must be -1 (off), 0 (off) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be 0 or more, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise bad(name, f"{name} must be 0 or more, got {value}.")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must not be empty.")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:
                    raise bad(
                        "logit_bias", f"logit_bias for token {token_id} must be in [-100, 100]."
                    )
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad("seed", "seed must fit in a signed 64-bit integer.")

    @property
    def uses_penalties(self) -> bool:
        """Whether the logits of a step depend on the tokens generated before it."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids) | set(self.extra_stop_token_ids)

    def verify_vocab(self, vocab_size: int) -> None:
        """Token ids the caller named must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            for token_id in ids or ():
                if not 0 <= token_id < vocab_size:
                    raise InvalidRequestError(
                        f"{name} names token id {token_id}, outside the vocabulary [0, {vocab_size}).",
                        param=name,
                    )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
