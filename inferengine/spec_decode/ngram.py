"""N-gram (prompt lookup) proposer: continue the text the way it went on the last time its tail
appeared earlier in the same request.

The tail of the request's tokens (prompt and output so far), longest first from
`prompt_lookup_max` down to `prompt_lookup_min` tokens, is looked up among the earlier tokens;
at the most recent earlier occurrence, the tokens that followed become the drafts, at most
`num_speculative_tokens` of them. Where that continuation runs into the end of the text, it goes
on copying itself (a text that repeats with period p is continued with period p: the loops of
small models and repeated fields of generated data are drafted in full). No model runs, so drafts are one-hot for the rejection sampler.
Strong where the output quotes or edits its input (summaries, code edits, agent loops).

Each request keeps an index from every n-gram (of the lookup lengths) that has a successor to
where its most recent occurrence ends; a step adds only the n-grams its new tokens complete, so
proposing costs O(lookup lengths × new tokens), not a scan of the whole text (it runs for every
request in the step loop). Requests without a `request_id` are looked up from scratch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from inferengine.config import SpeculativeConfig


@dataclass
class _Index:
    length: int = 0  # tokens indexed so far
    last: int = -1  # the last of them
    # n-gram -> position just after its most recent occurrence that has a successor
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._indexes: dict[str, _Index] = {}

    def propose(
        self,
        token_ids: Sequence[int] | np.ndarray,
        max_drafts: int | None = None,
        request_id: str = "",
        lookahead: int = 0,
    ) -> list[int]:
        """Draft tokens to follow `token_ids` (maybe none); at most `max_drafts` if given.
        With `lookahead`, the drafts follow that many guessed tokens (see `TokenProposer`)."""
        c = self.config
        limit = (
            c.num_speculative_tokens
            if max_drafts is None
            else min(max_drafts, c.num_speculative_tokens)
        )
        tokens = token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids
        if limit <= 0 or len(tokens) < 2:
            return []
        limit += lookahead
        index = self._index(request_id, tokens)
        n_tokens = len(tokens)
        for n in range(min(c.prompt_lookup_max, n_tokens - 1), c.prompt_lookup_min - 1, -1):
            start = index.ends.get(tuple(tokens[n_tokens - n :]))
            if start is not None:
                drafts = list(tokens[start : start + limit])
                for i in range(len(drafts), limit):
                    drafts.append(drafts[start + i - n_tokens])
                return drafts[lookahead:]
        return []

    def probe(self, token_ids: Sequence[int] | np.ndarray, request_id: str = "") -> bool:
        """Whether `propose` would draft now: the tail's `prompt_lookup_min` tokens occur
        earlier with a successor (any longer match contains that one). One vectorised pass
        over the text, no index: a request probed once costs no Python objects per token."""
        n = self.config.prompt_lookup_min
        if self.config.num_speculative_tokens <= 0 or len(token_ids) < n + 1:
            return False
        a = np.asarray(token_ids)
        last = len(a) - 1
        ends = a[n - 1 : last] == a[last]  # candidate ends e = n-1 .. last-1
        for j in range(1, n):
            ends &= a[n - 1 - j : last - j] == a[last - j]
        return bool(ends.any())

    def _index(self, request_id: str, tokens: Sequence[int]) -> _Index:
        """The request's index brought up to `tokens` (rebuilt if they are not a continuation
        of what it holds)."""
        index = self._indexes.get(request_id) if request_id else None
        if (
            index is None
            or index.length > len(tokens)
            or (index.length and index.last != tokens[index.length - 1])
        ):
            index = _Index()
            if request_id:
                self._indexes[request_id] = index
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        ends, old = index.ends, index.length
        # An n-gram ending at position e (inclusive) has a successor once e + 1 < len(tokens).
        for e in range(max(old - 1, 0), len(tokens) - 1):
            for n in range(lo, min(hi, e + 1) + 1):
                ends[tuple(tokens[e - n + 1 : e + 1])] = e + 1
        index.length, index.last = len(tokens), tokens[-1]
        return index

    def finish(
        self, request_id: str, token_ids: Sequence[int] | None = None, num_prompt_tokens: int = 0
    ) -> None:
        """Forget the request's index."""
        self._indexes.pop(request_id, None)
