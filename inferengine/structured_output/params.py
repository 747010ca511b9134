"""`StructuredOutputsParams`: vLLM's `structured_outputs` (one of json, regex, choice, grammar,
json_object), carried by `SamplingParams` and checked when the request is made."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inferengine.errors import InvalidRequestError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
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
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
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
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

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
