"""Speculative-decoding counters of a server over one benchmark run, and a digest of a run's
output lengths: what a speculation benchmark records beside the judge's timings.

Both servers export vLLM's counter names on /metrics (`vllm:spec_decode_num_drafts_total`,
`inferengine:spec_decode_num_drafts_total`, ...); the run's counts are the difference of two
scrapes, so they include the judge's warm-up requests. Greedy decoding with and without
speculation emits the same tokens, so the same output length per request (bar bf16 near-ties):
the digest lets a summary say whether two systems' outputs agree in length.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.error
import urllib.request
from collections.abc import Sequence

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_LINE = re.compile(
    r"^[a-z_]+:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens)_total(?:\{[^}]*\})?\s+(\S+)$"
)


def parse_spec_counters(text: str) -> dict[str, float]:
    """The spec-decode counters in a Prometheus text exposition, summed over their labels."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if match:
            totals[match.group(1)] += float(match.group(2))
    return totals


def scrape_spec_counters(base_url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """The server's counters now; None when /metrics cannot be read."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
            return parse_spec_counters(response.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def spec_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """The run's drafts, draft tokens and accepted tokens, with the acceptance rate and the
    mean accepted length (tokens per verify step: accepted drafts plus the one sampled);
    None when either scrape failed or nothing was drafted."""
    if before is None or after is None:
        return None
    delta = {name: int(after[name] - before[name]) for name in COUNTERS}
    if delta["num_drafts"] <= 0:
        return None
    return {
        "drafts": delta["num_drafts"],
        "draft_tokens": delta["num_draft_tokens"],
        "accepted_tokens": delta["num_accepted_tokens"],
        "acceptance_rate": delta["num_accepted_tokens"] / max(delta["num_draft_tokens"], 1),
        "mean_accepted_length": 1 + delta["num_accepted_tokens"] / delta["num_drafts"],
    }


def output_lens_digest(output_lens: Sequence[int] | None) -> str | None:
    """A short digest of a run's per-request output lengths, in request order."""
    if not output_lens:
        return None
    return hashlib.sha1(json.dumps(list(output_lens)).encode()).hexdigest()[:16]
