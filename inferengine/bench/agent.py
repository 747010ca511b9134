"""Multi-turn agent sessions against one server: conversations that grow by a tool output each
turn, think time between turns, TTFT of later turns, and the KV cache's hits by tier.

The workload (`AgentWorkload`; every draw follows from `seed`, so every system gets the same):

    N sessions, started with exponential gaps of mean `session_gap_s`, at most
    `max_active_sessions` of them between their first request and their last reply (a session
    waits for a slot, in order). Session i:
      turn 1   prefix: `prefix_len` random token ids (system prompt + task; its first
               `shared_prefix_len` tokens are the same in every session)
      turn t   the whole conversation so far: prompt(t-1) + reply(t-1) + tool(t), where tool(t)
               is a tool output of U tokens, U uniform over [tool_len_min, tool_len_max]
      each     asks for exactly `output_len` tokens (ignore_eos, temperature 0, streamed), after
               a think time (exponential, lognormal or fixed, of mean `think_time_s`) that starts
               when the previous reply ended

Prompts are token ids (the completions endpoint's `prompt: [ids]`; with `--api chat`,
`responses` or `messages` the same segments decoded to text and sent as messages, see
`agent_apis.py`), drawn like vLLM's random dataset from the tokenizer's base vocabulary without
its special tokens, so no tokenizer can make two systems see different prompts. reply(t) is NOT
what the server generated: it is `output_len` pseudo-random ids drawn from the seed, the same
for every system. Servers with dummy weights generate different text, and sending it back would
make the conversations differ; identical prompts matter more here than realism. The price: the
server's own KV of its reply never matches the next prompt, so the best possible hit of turn t
is prompt(t-1), rounded down to a block.

Each request carries `prompt_cache_key` (the session id) and `prompt_cache_retention` (default
"1h") unless `cache_fields` is off (the Messages API: a cache_control breakpoint of that ttl).
Our server keeps a session's pages leased for that long;
vLLM 0.26 ignores both (its request models allow extra fields and only log them at debug).

After the warm-up (the same `num_warmups` unrelated prompts for every system) and again after
the last reply, the runner scrapes the server's cache counters and reports their deltas:
    GET /metrics   {vllm,inferengine}:prefix_cache_{queries,hits}_total (GPU-tier tokens),
                   vllm:external_prefix_cache_{queries,hits}_total (vLLM's CPU offload connector:
                   queries are the tokens the GPU missed), vllm:kv_offload_{load,store}_bytes_total
    GET /stats     our `kv_tiers`: gpu_hit_tokens, cpu_hit_tokens, query_tokens, offloaded/loaded
                   blocks and bytes, leased_evicted_blocks (counters: their deltas); any other
                   field (leased_blocks, sessions, ...) is a level: its value at the end. When
                   present, these are the tier figures.
Hit rates are over all prompt tokens looked up: gpu_hit_rate + cpu_hit_rate = hit_rate. The
servers count lookups differently (ours counts every lookup, a preempted request's again; vLLM
leaves out those of preempted requests), so `client_hit_rate` (and `later_client_hit_rate`, turns >= 2) cross-checks
them: the sum of each reply's usage.prompt_tokens_details.cached_tokens over its prompt tokens,
once per request (vLLM reports it with --enable-prompt-tokens-details).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from inferengine.bench.agent_apis import make_sender
from inferengine.bench.client import RequestOutput
from inferengine.bench.runner import fetch_first_model, new_session
from inferengine.errors import ConfigError

THINK_DISTRIBUTIONS = ("exponential", "lognormal", "fixed")
# Prometheus counters (the part after "vllm:" or "inferengine:"), summed over their label sets.
PROMETHEUS_COUNTERS = (
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "external_prefix_cache_queries_total",
    "external_prefix_cache_hits_total",
    "kv_offload_load_bytes_total",
    "kv_offload_store_bytes_total",
)
# kv_tiers fields that count up; every other one (leased_blocks, sessions, ...) is a level,
# reported as its value at the end.
TIER_COUNTERS = (
    "query_tokens",
    "gpu_hit_tokens",
    "cpu_hit_tokens",
    "offloaded_blocks",
    "loaded_blocks",
    "offloaded_bytes",
    "loaded_bytes",
    "leased_evicted_blocks",
)
SETTLE_S = 0.5  # before the last scrape, so that the final step's stats have reached /metrics


@dataclass(frozen=True)
class AgentWorkload:
    """Everything that must be identical when two systems are compared."""

    sessions: int = 16
    turns: int = 4
    prefix_len: int = 1024
    shared_prefix_len: int = 0
    tool_len_min: int = 200
    tool_len_max: int = 400
    output_len: int = 64
    think_time_s: float = 2.0
    think_distribution: str = "exponential"
    think_sigma: float = 1.0  # lognormal: the sigma of the underlying normal
    session_gap_s: float = 0.5
    max_active_sessions: int = 8
    seed: int = 0
    num_warmups: int = 4
    prompt_cache_retention: str | None = "1h"
    cache_fields: bool = True
    request_timeout_s: float | None = 1800.0

    def check(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.max_active_sessions < 1:
            raise ConfigError("--sessions, --turns and --max-active-sessions must be at least 1")
        if self.seed < 0:
            raise ConfigError("--seed must be 0 or more")
        if self.prefix_len < 1 or self.output_len < 1:
            raise ConfigError("--prefix-len and --output-len must be at least 1")
        if not 0 <= self.shared_prefix_len <= self.prefix_len:
            raise ConfigError("--shared-prefix-len must lie in [0, --prefix-len]")
        if not 1 <= self.tool_len_min <= self.tool_len_max:
            raise ConfigError("--tool-len MIN:MAX needs 1 <= MIN <= MAX")
        if self.think_distribution not in THINK_DISTRIBUTIONS:
            raise ConfigError(f"--think-distribution must be one of {THINK_DISTRIBUTIONS}")
        if self.think_time_s < 0 or self.session_gap_s < 0 or self.think_sigma <= 0:
            raise ConfigError("--think-time and --session-gap must be >= 0, --think-sigma > 0")

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt (the last turn at the longest tool outputs)."""
        return self.prefix_len + (self.turns - 1) * (self.output_len + self.tool_len_max)

    def mean_final_len(self) -> float:
        """Mean tokens of a session's whole conversation, its last reply included."""
        tool = (self.tool_len_min + self.tool_len_max) / 2
        return self.prefix_len + (self.turns - 1) * tool + self.turns * self.output_len


@dataclass(frozen=True)
class Turn:
    index: int  # 1-based
    prompt_len: int
    think_s: float  # wait after the previous reply (0 for turn 1)


@dataclass
class Session:
    """One conversation: its segments (prefix, reply 1, tool 2, reply 2, tool 3, ...) and turns."""

    id: str
    start_s: float  # offset from the run's start
    segments: list[np.ndarray]
    turns: list[Turn]

    def prompt(self, turn: int) -> list[int]:
        """The token ids turn `turn` (1-based) sends: prefix, then (reply, tool) pairs."""
        return np.concatenate(self.segments[: 2 * turn - 1]).tolist()


def think_times(
    rng: np.random.Generator, n: int, mean_s: float, distribution: str, sigma: float = 1.0
) -> np.ndarray:
    """`n` think times of mean `mean_s` seconds."""
    if mean_s == 0 or distribution == "fixed":
        return np.full(n, float(mean_s))
    if distribution == "exponential":
        return rng.exponential(mean_s, n)
    if distribution == "lognormal":  # E[exp(N(mu, s^2))] = exp(mu + s^2 / 2) = mean
        return rng.lognormal(math.log(mean_s) - sigma**2 / 2, sigma, n)
    raise ConfigError(f"unknown think-time distribution {distribution!r}")


def allowed_ids(tokenizer: Any) -> np.ndarray:
    """Token ids a random prompt may use: the base vocabulary less special tokens (as vLLM)."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)


def build_sessions(w: AgentWorkload, ids: np.ndarray) -> list[Session]:
    """The sessions of `w`, drawn from `ids`. Session i depends only on (seed, i): adding
    sessions leaves the earlier ones as they were."""
    w.check()
    shared = ids[np.random.default_rng([w.seed, 0]).integers(0, len(ids), w.shared_prefix_len)]
    gaps = np.random.default_rng([w.seed, 1]).exponential(w.session_gap_s or 1.0, w.sessions)
    starts = np.concatenate([[0.0], np.cumsum(gaps[1:])]) * (w.session_gap_s > 0)
    sessions = []
    for i in range(w.sessions):
        rng = np.random.default_rng([w.seed, 2, i])

        def draw(n: int, rng: np.random.Generator = rng) -> np.ndarray:
            return ids[rng.integers(0, len(ids), n)]

        segments = [np.concatenate([shared, draw(w.prefix_len - w.shared_prefix_len)])]
        think_rng = np.random.default_rng([w.seed, 4, i])  # prompts do not depend on it
        thinks = think_times(
            think_rng, w.turns, w.think_time_s, w.think_distribution, w.think_sigma
        )
        turns = [Turn(1, w.prefix_len, 0.0)]
        for t in range(2, w.turns + 1):
            segments.append(draw(w.output_len))  # reply(t - 1)
            segments.append(draw(int(rng.integers(w.tool_len_min, w.tool_len_max + 1))))
            length = turns[-1].prompt_len + len(segments[-2]) + len(segments[-1])
            turns.append(Turn(t, length, float(thinks[t - 1])))
        sessions.append(Session(f"agent-{w.seed}-{i:04d}", float(starts[i]), segments, turns))
    return sessions


def warmup_prompts(w: AgentWorkload, ids: np.ndarray) -> list[list[int]]:
    """`num_warmups` prompts of `prefix_len` tokens that share nothing with the sessions."""
    rng = np.random.default_rng([w.seed, 3])
    return [ids[rng.integers(0, len(ids), w.prefix_len)].tolist() for _ in range(w.num_warmups)]


@dataclass
class TurnRecord:
    session: str
    turn: int
    prompt_len: int
    start_s: float  # from the run's start
    out: RequestOutput


@dataclass
class AgentTarget:
    """Where to send, and what this server needs in each request."""

    base_url: str
    model: str | None = None
    extra_body: dict = field(default_factory=dict)
    send_ignore_eos: bool = True
    api: str = "completions"  # or chat, responses, messages (`agent_apis.py`)
    decode: Callable[[list[int]], str] | None = None  # token ids to text, for the text APIs


async def run_agent(
    w: AgentWorkload, target: AgentTarget, sessions: Sequence[Session], ids: np.ndarray
) -> dict:
    """Warm up, scrape, run every session, scrape again; the result (no per-request arrays)."""
    base_url = target.base_url.rstrip("/")
    async with new_session(None) as http:
        model = target.model or (await fetch_first_model(http, base_url))[0]

        send = make_sender(
            target.api,
            http,
            base_url,
            model,
            w,
            target.extra_body,
            target.send_ignore_eos,
            target.decode,
        )
        warm = [np.asarray(p, dtype=np.int64) for p in warmup_prompts(w, ids)]
        warm_outs = await asyncio.gather(*(send([p], None) for p in warm))
        before = await scrape_cache(http, base_url)
        records: list[TurnRecord] = []
        slots = asyncio.Semaphore(w.max_active_sessions)
        start = time.perf_counter()

        async def converse(s: Session) -> None:
            try:
                for turn in s.turns:
                    if turn.think_s > 0:
                        await asyncio.sleep(turn.think_s)
                    # A failed turn does not end the session: every system gets every request.
                    out = await send(s.segments[: 2 * turn.index - 1], s.id)
                    records.append(
                        TurnRecord(s.id, turn.index, turn.prompt_len, out.start_time - start, out)
                    )
            finally:
                slots.release()

        tasks = []
        for s in sessions:
            delay = start + s.start_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            tasks.append(asyncio.create_task(converse(s)))
        await asyncio.gather(*tasks)
        ends = [r.start_s + r.out.latency for r in records if r.out.success]
        duration = max(ends, default=time.perf_counter() - start)
        await asyncio.sleep(SETTLE_S)
        after = await scrape_cache(http, base_url)
    result = {"client": "inferengine bench agent", "base_url": base_url, "model_id": model}
    result["api"] = target.api
    result |= agent_metrics(records, duration)
    result["warmup_failed"] = sum(not o.success for o in warm_outs)
    result["cache"] = cache_summary(before, after)
    return result


def _percentiles(values_s: Sequence[float], metric: str, scope: str = "") -> dict:
    """`{scope}{median,p99,mean}_{metric}_ms` (linear interpolation, as vLLM); None if empty."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = {"median": np.median, "p99": lambda x: np.percentile(x, 99), "mean": np.mean}
    return {
        f"{scope}{stat}_{metric}_ms": float(fn(ms)) if len(ms) else None
        for stat, fn in stats.items()
    }


def agent_metrics(records: Sequence[TurnRecord], duration_s: float) -> dict:
    """Throughput and TTFT/E2E percentiles for turn 1, turns >= 2 and all, and TTFT per turn."""
    ok = [r for r in records if r.out.success]
    first = [r.out.ttft for r in ok if r.turn == 1]
    later = [r.out.ttft for r in ok if r.turn >= 2]
    # The server's usage.prompt_tokens when it reports one (it always should), else ours.
    input_tokens = sum(r.out.prompt_len or r.prompt_len for r in ok)
    output_tokens = sum(r.out.output_tokens for r in ok)
    errors = sorted({r.out.error for r in records if not r.out.success})
    by_turn = {}
    for t in sorted({r.turn for r in ok}):
        by_turn[str(t)] = float(np.median([r.out.ttft for r in ok if r.turn == t]) * 1000.0)
    metrics = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "num_turn1": len(first),
        "num_later": len(later),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else None,
        "output_throughput": output_tokens / duration_s if duration_s else None,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s
        if duration_s
        else None,
    }
    metrics |= _percentiles(first, "ttft", "turn1_")
    metrics |= _percentiles(later, "ttft", "later_")
    metrics |= _percentiles([r.out.ttft for r in ok], "ttft")
    metrics |= _percentiles([r.out.latency for r in ok], "e2el")
    # The server's own count of each prompt's cached tokens (any tier), once per request.
    for scope, mine in (("", ok), ("later_", [r for r in ok if r.turn >= 2])):
        told = [r.out for r in mine if r.out.cached_tokens is not None]
        cached, prompt = sum(o.cached_tokens or 0 for o in told), sum(o.prompt_len for o in told)
        metrics[f"{scope}client_hit_rate"] = cached / prompt if told and prompt else None
    metrics["num_cached_tokens_reported"] = sum(r.out.cached_tokens is not None for r in ok)
    metrics["median_ttft_ms_by_turn"] = by_turn
    metrics["errors"] = errors[:5]
    return metrics


def parse_prometheus(text: str, names: Sequence[str] = PROMETHEUS_COUNTERS) -> dict[str, float]:
    """The `names` (without the "vllm:"/"inferengine:" namespace) summed over their label sets."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, rest = line.partition(" ") if "{" not in line else line.partition("} ")
        metric = series.split("{", 1)[0].split(":", 1)[-1]
        if metric in names:
            try:
                sums[metric] = sums.get(metric, 0.0) + float(rest.split()[0])
            except (IndexError, ValueError):
                continue
    return sums


async def scrape_cache(http: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """Cache counters from /metrics and our /stats `kv_tiers` ("tier.<field>"); what a server
    does not serve is left out."""
    counters: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with http.get(f"{base_url}/metrics", timeout=timeout) as response:
            if response.status == 200:
                counters |= parse_prometheus(await response.text())
        async with http.get(f"{base_url}/stats", timeout=timeout) as response:
            if response.status == 200:
                tiers = (await response.json()).get("kv_tiers") or {}
                counters |= {
                    f"tier.{k}": float(v)
                    for k, v in tiers.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                }
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        print(f"could not scrape {base_url}: {type(e).__name__}: {e}")
    return counters


def cache_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """Deltas over the measured run, and the hit rates by tier."""
    delta = {
        k: v - before.get(k, 0.0) if not k.startswith("tier.") or k[5:] in TIER_COUNTERS else v
        for k, v in after.items()
    }
    if "tier.query_tokens" in delta:
        source = "/stats kv_tiers"
        queries = delta["tier.query_tokens"]
        gpu, cpu = delta.get("tier.gpu_hit_tokens"), delta.get("tier.cpu_hit_tokens")
        loaded, stored = delta.get("tier.loaded_bytes"), delta.get("tier.offloaded_bytes")
    elif "prefix_cache_queries_total" in delta:
        source = "/metrics"
        queries = delta["prefix_cache_queries_total"]
        gpu = delta.get("prefix_cache_hits_total")
        cpu = delta.get("external_prefix_cache_hits_total")
        loaded = delta.get("kv_offload_load_bytes_total")
        stored = delta.get("kv_offload_store_bytes_total")
    else:
        return {"source": None, "counters": delta}

    def rate(hits: float | None) -> float | None:
        return hits / queries if hits is not None and queries else None

    total = None if gpu is None else gpu + (cpu or 0.0)
    return {
        "source": source,
        "query_tokens": queries,
        "gpu_hit_tokens": gpu,
        "cpu_hit_tokens": cpu,
        "gpu_hit_rate": rate(gpu),
        "cpu_hit_rate": rate(cpu),
        "hit_rate": rate(total),
        "loaded_bytes": loaded,
        "offloaded_bytes": stored,
        "counters": delta,
    }


def format_result(result: dict) -> str:
    """A few lines: TTFT of turn 1 and of later turns, throughput, hit rates."""

    def ms(key: str) -> str:
        v = result.get(key)
        return "-" if v is None else f"{v:.1f}"

    c = result.get("cache") or {}
    rates = " ".join(
        f"{k.removesuffix('_hit_rate')} {c[k]:.3f}"
        for k in ("gpu_hit_rate", "cpu_hit_rate", "hit_rate")
        if c.get(k) is not None
    )
    return (
        f"{result['completed']} turns ok, {result['failed']} failed in {result['duration']:.1f} s; "
        f"TTFT ms turn 1 p50 {ms('turn1_median_ttft_ms')} p99 {ms('turn1_p99_ttft_ms')}, "
        f"turns>=2 p50 {ms('later_median_ttft_ms')} p99 {ms('later_p99_ttft_ms')}; "
        f"{result['output_throughput'] or 0:.1f} out tok/s, "
        f"{result['total_token_throughput'] or 0:.1f} total tok/s; "
        f"hits ({c.get('source') or 'no counters'}) {rates or '-'}"
    )
