"""Draft-model speculative decoding through the engine: greedy tokens equal plain decoding's
(mixed batches, chunked prefill, preemption, prefix hits); the target as its own draft model has
every draft accepted; a draft with another vocabulary or a shorter context fails at start-up."""

from __future__ import annotations

import json
import shutil

import pytest

from inferengine import LLM
from inferengine.errors import ConfigError
from tests.spec_decode.test_ngram_engine import _run


def _spec(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 2048},
        {"max_num_batched_tokens": 40},  # chunked prefill, drafts trimmed to the budget
        {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 30},  # preemption
    ],
)
def test_draft_model_greedy_matches_plain_decoding(tiny_checkpoint, kwargs):
    target = str(tiny_checkpoint("qwen2"))
    plain, _, _, _ = _run(target, None, **kwargs)
    spec, _, stats, drafted_ahead = _run(target, _spec(tiny_checkpoint("llama3-tied")), **kwargs)
    assert spec == plain
    assert drafted_ahead == 0  # a draft model drafts from every token: never ahead
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens


@pytest.mark.parametrize(
    "kwargs", [{}, {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 30}]
)
def test_target_as_its_own_draft_has_every_draft_accepted(tiny_checkpoint, kwargs):
    target = tiny_checkpoint("llama3-tied")
    plain, _, _, _ = _run(str(target), None, **kwargs)
    spec, _, stats, _ = _run(str(target), _spec(target, k=4), **kwargs)
    assert spec == plain
    assert stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def _edited_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_draft_with_another_vocabulary_or_shorter_context_fails_at_start_up(
    tiny_checkpoint, tmp_path
):
    target = str(tiny_checkpoint("qwen2"))
    src = tiny_checkpoint("llama3-tied")
    other_vocab = _edited_copy(src, tmp_path / "vocab", vocab_size=999)
    with pytest.raises(ConfigError, match="vocabulary of 999 tokens"):
        LLM(target, max_model_len=256, speculative_config=_spec(other_vocab))
    short = _edited_copy(src, tmp_path / "short", max_position_embeddings=128)
    with pytest.raises(ConfigError, match="lower --max-model-len to 128"):
        LLM(target, max_model_len=256, speculative_config=_spec(short))
