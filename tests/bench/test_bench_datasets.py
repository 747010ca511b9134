"""Benchmark datasets: exact prompt lengths, length ranges, shared prefixes, ShareGPT filtering."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from inferengine.bench.config import DatasetConfig
from inferengine.bench.datasets import allowed_token_ids, fit_to_length, sample_requests
from inferengine.errors import ConfigError


def retokenized(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5])
def test_random_lengths_lie_in_the_range(tokenizer, ratio):
    cfg = DatasetConfig(
        num_prompts=200, random_input_len=60, random_output_len=20, random_range_ratio=ratio
    )
    requests = sample_requests(cfg, tokenizer)
    assert len(requests) == 200
    in_lo, in_hi = math.floor(60 * (1 - ratio)), math.ceil(60 * (1 + ratio))
    out_lo, out_hi = math.floor(20 * (1 - ratio)), math.ceil(20 * (1 + ratio))
    for r in requests:
        assert in_lo <= r.prompt_len <= in_hi
        assert out_lo <= r.expected_output_len <= out_hi
        assert retokenized(tokenizer, r.prompt) == r.prompt_len  # the text has that many tokens
    if ratio > 0:  # spread over the range, not stuck at one value
        assert len({r.expected_output_len for r in requests}) > (out_hi - out_lo) // 2


def test_random_is_reproducible_and_seeded(tokenizer):
    cfg = DatasetConfig(num_prompts=20, random_input_len=30, random_output_len=10, seed=3)
    assert sample_requests(cfg, tokenizer) == sample_requests(cfg, tokenizer)
    other = DatasetConfig(num_prompts=20, random_input_len=30, random_output_len=10, seed=4)
    assert sample_requests(other, tokenizer) != sample_requests(cfg, tokenizer)


def test_random_lengths_are_drawn_as_vllm_draws_them(tokenizer):
    # vLLM: default_rng(seed); input lens, then output lens, over the integer ranges.
    cfg = DatasetConfig(
        num_prompts=50, random_input_len=40, random_output_len=16, random_range_ratio=0.5, seed=7
    )
    rng = np.random.default_rng(7)
    want_in = rng.integers(20, 60 + 1, size=50)
    want_out = rng.integers(8, 24 + 1, size=50)
    requests = sample_requests(cfg, tokenizer)
    assert [r.prompt_len for r in requests] == want_in.tolist()
    assert [r.expected_output_len for r in requests] == want_out.tolist()


def test_random_prefix_is_shared(tokenizer):
    cfg = DatasetConfig(
        num_prompts=10, random_input_len=20, random_output_len=4, random_prefix_len=25
    )
    requests = sample_requests(cfg, tokenizer)
    prefix = requests[0].prompt[:40]
    assert all(r.prompt.startswith(prefix) for r in requests)
    assert all(r.prompt_len == 45 for r in requests)


def test_fit_to_length_reaches_the_target(tokenizer):
    allowed = allowed_token_ids(tokenizer)
    rng = np.random.default_rng(0)
    assert not set(allowed.tolist()) & set(tokenizer.all_special_ids)
    for target in (1, 7, 33, 120):
        text, ids = fit_to_length(tokenizer, allowed[:target].tolist(), target, rng, allowed)
        assert len(ids) == target == retokenized(tokenizer, text)


def test_prefix_repetition_shares_long_prefixes(tokenizer):
    cfg = DatasetConfig(
        name="prefix-repetition",
        num_prompts=12,
        prefix_repetition_prefix_len=40,
        prefix_repetition_suffix_len=10,
        prefix_repetition_num_prefixes=3,
        prefix_repetition_output_len=5,
    )
    requests = sample_requests(cfg, tokenizer)
    assert len(requests) == 12
    assert {r.expected_output_len for r in requests} == {5}
    assert {r.prompt_len for r in requests} == {50}
    # 3 groups of 4 prompts: within a group, the first 40 tokens are the same.
    heads = [tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:40]) for r in requests]
    assert sorted(heads.count(h) for h in set(heads)) == [4, 4, 4]


def test_prefix_repetition_needs_a_prompt_per_prefix(tokenizer):
    cfg = DatasetConfig(name="prefix_repetition", num_prompts=2, prefix_repetition_num_prefixes=3)
    with pytest.raises(ConfigError):
        sample_requests(cfg, tokenizer)


def test_sharegpt_takes_first_human_turn_and_filters(tokenizer, tmp_path):
    long_text = "word " * 1100
    data = [
        {"conversations": [{"from": "human", "value": "Tell me about paged attention please"},
                           {"from": "gpt", "value": "It keeps the cache in blocks of tokens."}]},
        {"conversations": [{"from": "system", "value": "be brief"},
                           {"from": "human", "value": "What is the time to first token?"},
                           {"from": "gpt", "value": "The wait before the first token shows."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": long_text},
                           {"from": "gpt", "value": "too long a prompt to keep"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    cfg = DatasetConfig(name="sharegpt", path=str(path), num_prompts=2, seed=0)
    requests = sample_requests(cfg, tokenizer)
    prompts = {r.prompt for r in requests}
    assert prompts == {
        "Tell me about paged attention please",
        "What is the time to first token?",
    }
    for r in requests:
        assert r.prompt_len == len(tokenizer(r.prompt).input_ids)
        reply = "It keeps" if r.prompt.startswith("Tell") else "The wait"
        want = next(
            len(tokenizer(t["value"]).input_ids)
            for e in data
            for t in e["conversations"]
            if t["value"].startswith(reply)
        )
        assert r.expected_output_len == want

    # A fixed output length; more prompts than conversations are oversampled.
    fixed = DatasetConfig(name="sharegpt", path=str(path), num_prompts=5, sharegpt_output_len=9)
    requests = sample_requests(fixed, tokenizer)
    assert len(requests) == 5 and {r.expected_output_len for r in requests} == {9}


def test_unknown_dataset_is_a_config_error(tokenizer):
    with pytest.raises(ConfigError):
        sample_requests(DatasetConfig(name="sonnet"), tokenizer)


def test_custom_prompts_go_as_written_in_file_order(tokenizer, tmp_path):
    from inferengine.bench.vllm_client import vllm_bench_flags
    from inferengine.bench.workloads import WORKLOADS

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two"}\n\n{"prompt": "three"}\n')
    cfg = DatasetConfig(name="custom", path=str(path), num_prompts=3, custom_output_len=7)
    requests = sample_requests(cfg, tokenizer)
    assert [r.prompt for r in requests] == ["one two", "three", "one two"]
    assert [r.expected_output_len for r in requests] == [7, 7, 7]
    assert requests[0].prompt_len == retokenized(tokenizer, "one two")
    # vLLM's client gets the same prompts: no chat template, no shuffling.
    flags = vllm_bench_flags(WORKLOADS["grounded"].workload, "http://h:1", "m", "/tok")
    i = flags.index("--dataset-name")
    assert flags[i + 1] == "custom"
    assert {"--skip-chat-template", "--disable-shuffle"} <= set(flags)
    assert flags[flags.index("--custom-output-len") + 1] == "256"
    assert "--ignore-eos" not in flags
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1"):
        sample_requests(DatasetConfig(name="custom", path=str(bad), num_prompts=1), tokenizer)
    with pytest.raises(ConfigError, match="needs --dataset-path"):
        sample_requests(DatasetConfig(name="custom", num_prompts=1), tokenizer)
