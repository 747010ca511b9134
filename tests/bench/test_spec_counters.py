"""Parsing speculative-decoding counters from both servers' /metrics, and their deltas."""

from __future__ import annotations

import pytest

from inferengine.bench.spec_counters import output_lens_digest, parse_spec_counters, spec_delta

VLLM = """\
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0
"""
OURS = """\
inferengine:spec_decode_num_drafts_total{model_name="m",engine="0"} 4.0
inferengine:spec_decode_num_drafts_total{model_name="m",engine="1"} 6.0
inferengine:spec_decode_num_draft_tokens_total{model_name="m",engine="0"} 12.0
inferengine:spec_decode_num_accepted_tokens_total{model_name="m",engine="0"} 7.0
"""


def test_counters_of_either_server_sum_over_labels_and_skip_other_series():
    assert parse_spec_counters(VLLM) == {
        "num_drafts": 10.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 25.0
    }  # fmt: skip
    assert parse_spec_counters(OURS) == {
        "num_drafts": 10.0, "num_draft_tokens": 12.0, "num_accepted_tokens": 7.0
    }  # fmt: skip
    assert parse_spec_counters("# nothing speculative\n") == dict.fromkeys(
        ("num_drafts", "num_draft_tokens", "num_accepted_tokens"), 0.0
    )


def test_delta_gives_rates_and_none_without_drafts_or_a_scrape():
    before = parse_spec_counters(OURS)
    after = {k: v * 3 for k, v in before.items()}
    assert spec_delta(before, after) == {
        "drafts": 20, "draft_tokens": 24, "accepted_tokens": 14,
        "acceptance_rate": pytest.approx(14 / 24), "mean_accepted_length": pytest.approx(1.7),
    }  # fmt: skip
    assert spec_delta(before, before) is None
    assert spec_delta(None, after) is None and spec_delta(before, None) is None


def test_digest_tells_output_lengths_apart():
    assert output_lens_digest([3, 5, 8]) == output_lens_digest((3, 5, 8))
    assert output_lens_digest([3, 5, 8]) != output_lens_digest([3, 8, 5])
    assert output_lens_digest([]) is None and output_lens_digest(None) is None
