"""Benchmark prompts: random text of exact token lengths, ShareGPT conversations, shared prefixes.

The random dataset draws its lengths in the same order as vLLM's `vllm bench serve`, so that with
the same seed both clients ask for the same input and output lengths.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferengine.bench.config import DatasetConfig
from inferengine.errors import ConfigError
from inferengine.logger import init_logger

logger = init_logger(__name__)

# ShareGPT filters (vLLM's `is_valid_sequence`): drop tiny and overlong conversations.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
HUMAN_ROLES = ("human", "user")


@dataclass(frozen=True)
class SampleRequest:
    """One prompt, its token count under the benchmark tokenizer, and the output length to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def load_tokenizer(name_or_path: str) -> Any:
    """A Hugging Face tokenizer from a local folder (or a hub id when the hub is reachable)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a bad path
        raise ConfigError(
            f"could not load a tokenizer from {name_or_path!r} ({e}); pass --tokenizer with a "
            "folder that holds tokenizer files"
        ) from e


def sample_requests(cfg: DatasetConfig, tokenizer: Any) -> list[SampleRequest]:
    """The dataset's requests, `cfg.num_prompts` of them (fewer only where the dataset says so)."""
    name = cfg.name.replace("_", "-")
    if cfg.num_prompts < 1:
        raise ConfigError("--num-prompts must be at least 1")
    if name == "random":
        return sample_random(cfg, tokenizer)
    if name == "sharegpt":
        return sample_sharegpt(cfg, tokenizer)
    if name == "prefix-repetition":
        return sample_prefix_repetition(cfg, tokenizer)
    if name == "custom":
        return sample_custom(cfg, tokenizer)
    raise ConfigError(
        f"unknown dataset {cfg.name!r}; use random, sharegpt, prefix-repetition or custom"
    )


def sample_custom(cfg: DatasetConfig, tokenizer: Any) -> list[SampleRequest]:
    """The first `num_prompts` lines of a JSONL file of {"prompt": text}, in file order and
    repeated from the top when there are fewer (vLLM's custom dataset with --disable-shuffle
    and --skip-chat-template: the prompts are sent as written)."""
    if not cfg.path or not Path(cfg.path).is_file():
        raise ConfigError(
            '--dataset-name custom needs --dataset-path: a JSONL file of {"prompt": ...} lines'
        )
    prompts = []
    for number, line in enumerate(Path(cfg.path).read_text().splitlines(), 1):
        if line.strip():
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ConfigError(f'{cfg.path}:{number}: expected {{"prompt": "..."}}')
            prompts.append(record["prompt"])
    if not prompts:
        raise ConfigError(f"{cfg.path} holds no prompts")
    if cfg.custom_output_len < 1:
        raise ConfigError("--custom-output-len must be at least 1")
    chosen = [prompts[i % len(prompts)] for i in range(cfg.num_prompts)]
    return [
        SampleRequest(
            p, len(tokenizer(p, add_special_tokens=False).input_ids), cfg.custom_output_len
        )
        for p in chosen
    ]


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """Base-vocabulary ids that decode to whole characters on their own, in order.

    Special tokens are left out (a server would read them as control tokens), and so are byte
    pieces of multi-byte characters, which decode to U+FFFD and re-tokenize to other lengths.
    """
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    return np.array([i for i, t in zip(ids, texts, strict=True) if t and "\ufffd" not in t])


def fit_to_length(
    tokenizer: Any,
    token_ids: list[int],
    target: int,
    rng: np.random.Generator,
    allowed: np.ndarray,
    max_retry: int = 10,
) -> tuple[str, list[int]]:
    """Text whose re-tokenized length is `target` where reachable, and its token ids.

    Decoding then encoding does not always give back as many tokens (merges across the joins),
    so pad with random allowed ids or truncate and try again, up to `max_retry` times; if still
    too long, drop characters from the end until it fits.
    """
    ids = list(token_ids)
    for attempt in range(max_retry + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target or attempt == max_retry:
            break
        if len(ids) < target:
            ids = ids + allowed[rng.integers(0, len(allowed), size=target - len(ids))].tolist()
        else:
            ids = ids[:target]
    while len(ids) > target and text:
        text = text[:-1]
        ids = tokenizer.encode(text, add_special_tokens=False)
    return text, ids


def length_range(length: int, range_ratio: float, minimum: int = 0) -> tuple[int, int]:
    """Integer bounds [floor(L(1-r)), ceil(L(1+r))], each at least `minimum`."""
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), minimum)
    return low, high


def sample_random(cfg: DatasetConfig, tokenizer: Any) -> list[SampleRequest]:
    """Random token strings: lengths uniform in [L(1-r), L(1+r)], an optional shared prefix."""
    if not 0.0 <= cfg.random_range_ratio < 1.0:
        raise ConfigError("--random-range-ratio must be in [0, 1)")
    n = cfg.num_prompts
    rng = np.random.default_rng(cfg.seed)
    # The server adds special tokens (BOS) to a completion prompt; leave room for them.
    num_special = int(tokenizer.num_special_tokens_to_add())
    in_low, in_high = length_range(
        max(0, cfg.random_input_len - num_special), cfg.random_range_ratio
    )
    out_low, out_high = length_range(cfg.random_output_len, cfg.random_range_ratio, minimum=1)
    if cfg.random_prefix_len + in_low < 1:
        raise ConfigError("--random-input-len is too small: prompts would be empty")
    input_lens = rng.integers(in_low, in_high + 1, size=n)
    output_lens = rng.integers(out_low, out_high + 1, size=n)
    offsets = rng.integers(0, tokenizer.vocab_size, size=n)

    allowed = allowed_token_ids(tokenizer)
    prefix: list[int] = []
    if cfg.random_prefix_len > 0:
        raw = allowed[rng.integers(0, len(allowed), size=cfg.random_prefix_len)].tolist()
        _, prefix = fit_to_length(tokenizer, raw, cfg.random_prefix_len, rng, allowed)

    requests = []
    mismatch = 0
    for i in range(n):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        target = cfg.random_prefix_len + int(input_lens[i])
        text, ids = fit_to_length(tokenizer, prefix + inner, target, rng, allowed)
        mismatch += len(ids) - target
        requests.append(SampleRequest(text, len(ids), int(output_lens[i])))
    if mismatch:
        logger.warning("random prompts re-tokenize to %+d tokens in total vs. targets", mismatch)
    return requests


def sample_prefix_repetition(cfg: DatasetConfig, tokenizer: Any) -> list[SampleRequest]:
    """`num_prefixes` random prefixes, each shared by num_prompts // num_prefixes prompts."""
    per_prefix = cfg.num_prompts // cfg.prefix_repetition_num_prefixes
    if per_prefix == 0:
        raise ConfigError("--num-prompts must be at least --prefix-repetition-num-prefixes")
    if per_prefix * cfg.prefix_repetition_num_prefixes != cfg.num_prompts:
        logger.warning(
            "prefix-repetition sends %d prompts (a multiple of the number of prefixes)",
            per_prefix * cfg.prefix_repetition_num_prefixes,
        )
    rng = np.random.default_rng(cfg.seed)
    allowed = allowed_token_ids(tokenizer)

    def exact(length: int) -> list[int]:
        raw = allowed[rng.integers(0, len(allowed), size=length)].tolist()
        return fit_to_length(tokenizer, raw, length, rng, allowed)[1]

    requests = []
    for _ in range(cfg.prefix_repetition_num_prefixes):
        prefix = exact(cfg.prefix_repetition_prefix_len)
        for _ in range(per_prefix):
            ids = prefix + exact(cfg.prefix_repetition_suffix_len)
            requests.append(
                SampleRequest(tokenizer.decode(ids), len(ids), cfg.prefix_repetition_output_len)
            )
    random.Random(cfg.seed).shuffle(requests)
    return requests


def first_exchange(conversation: list[dict]) -> tuple[str, str] | None:
    """The first human turn and the reply to it."""
    for i, turn in enumerate(conversation[:-1]):
        if turn.get("from", turn.get("role")) in HUMAN_ROLES:
            reply = conversation[i + 1]
            return str(turn.get("value", turn.get("content", ""))), str(
                reply.get("value", reply.get("content", ""))
            )
    return None


def sample_sharegpt(cfg: DatasetConfig, tokenizer: Any) -> list[SampleRequest]:
    """ShareGPT JSON: first human turn as prompt, the reply's token count as output length."""
    if not cfg.path:
        raise ConfigError("the sharegpt dataset needs --dataset-path FILE.json")
    try:
        data = json.loads(Path(cfg.path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"could not read ShareGPT file {cfg.path}: {e}") from e
    conversations = [
        e["conversations"]
        for e in data
        if isinstance(e, dict) and len(e.get("conversations") or []) >= 2
    ]
    random.Random(cfg.seed).shuffle(conversations)
    fixed_output = cfg.sharegpt_output_len
    requests: list[SampleRequest] = []
    for conversation in conversations:
        if len(requests) >= cfg.num_prompts:
            break
        exchange = first_exchange(conversation)
        if exchange is None:
            continue
        prompt, reply = exchange
        prompt_len = len(tokenizer(prompt).input_ids)
        output_len = fixed_output or len(tokenizer(reply).input_ids)
        too_short = prompt_len < SHAREGPT_MIN_LEN or (
            fixed_output is None and output_len < SHAREGPT_MIN_LEN
        )
        too_long = (
            prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN
        )
        if not (too_short or too_long):
            requests.append(SampleRequest(prompt, prompt_len, output_len))
    if not requests:
        raise ConfigError(f"no usable conversations in {cfg.path}")
    if len(requests) < cfg.num_prompts:  # oversample, as vLLM does
        pick = random.Random(cfg.seed)
        requests += [pick.choice(requests) for _ in range(cfg.num_prompts - len(requests))]
    return requests
