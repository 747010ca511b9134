"""Fixtures for the benchmark tests: a tiny trained tokenizer on disk and the fake server."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_server import FakeConfig, FakeServer

CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Serving benchmarks measure time to first token, inter-token latency and throughput.",
    "Paged attention keeps the key value cache in fixed size blocks shared between prompts.",
    "Numbers 0123456789 and symbols !?.,;:()[]{} appear too, with Zürich, café and 東京.",
]


def build_tokenizer_dir(out: Path) -> Path:
    """A byte-level BPE tokenizer (vocab 400) trained here, saved as a transformers folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("bench-tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from inferengine.bench.datasets import load_tokenizer

    return load_tokenizer(str(tokenizer_dir))


@pytest.fixture
def fake_server():
    """fake_server(**FakeConfig fields) -> a running FakeServer, stopped after the test."""
    servers: list[FakeServer] = []

    def start(**kwargs) -> FakeServer:
        server = FakeServer(FakeConfig(**kwargs)).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)
