"""Incremental detokenization: text deltas as token ids arrive, right across UTF-8 and spaces.

Each step decodes a short window of tokens twice (with and without the new ones) and emits the
difference, so leading-space tokens and characters split over several byte tokens come out as
the full decode would write them.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special = set(tokenizer.all_special_ids) if skip_special_tokens else set()
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.tokens: list[str] = self._to_tokens(context)
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        kept = [t for t in token_ids if t not in self._special]
        # Ids past the tokenizer's vocabulary (a model with a padded vocab) decode to nothing.
        return [t for t in self.tokenizer.convert_ids_to_tokens(kept) if t is not None]

    def update(self, new_token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the text they complete (possibly empty).

        With `final`, bytes of an unfinished character are flushed as U+FFFD, as a full decode
        would write them.
        """
        self.tokens.extend(self._to_tokens(new_token_ids))
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(self.tokens[self.prefix_offset : self.read_offset])
        full_text = convert(self.tokens[self.prefix_offset :])
        incomplete = full_text.endswith(_INCOMPLETE) and not final
        if len(full_text) <= len(prefix_text) or incomplete:
            return ""  # wait for the rest of a multi-byte character
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.output_text += delta
        return delta
