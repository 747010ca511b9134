"""One tiny-model `LLM` for the batch tests."""

from __future__ import annotations

import pytest

from inferengine import LLM
from tests.entrypoints.batch.helpers import MAX_MODEL_LEN


@pytest.fixture(scope="session")
def batch_llm(tiny_checkpoint) -> LLM:
    return LLM(
        str(tiny_checkpoint("qwen3")),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        kv_cache_memory=16 << 20,
    )
