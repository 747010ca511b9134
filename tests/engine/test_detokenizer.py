"""Incremental detokenization equals a full decode, token by token, on hard tokenizers."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from inferengine.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import build_tokenizer

TEXTS = [
    "Hello world, how are you today?",
    "Zürich café naïve — 東京 🙂 and more 🙂🙂",
    "  leading spaces and\nnew lines\n\n  ",
]


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Metaspace (▁ for spaces) tokenizer with byte fallback, like Llama 2's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator(
        ["Hello world how are you today leading spaces new lines"] * 20, trainer
    )
    # Byte tokens are ordinary vocabulary entries (as in Llama 2), used for unseen characters.
    vocab = trained.get_vocab()
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    state = json.loads(trained.to_str())
    merges = [
        tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["model"]["merges"]
    ]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = trained.normalizer
    tok.pre_tokenizer = trained.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(params=["byte-level", "sentencepiece-like"])
def tokenizer(request):
    return build_tokenizer() if request.param == "byte-level" else _sentencepiece_like()


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.update([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    full = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
    assert prompt_text + "".join(pieces) == full
    assert "\ufffd" not in "".join(pieces)


def test_multibyte_character_split_over_tokens_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.update([t]) for t in ids]
    if len(ids) > 1:
        assert all(p == "" for p in pieces[:-1])
    assert pieces[-1].endswith("🙂")


def test_special_tokens_skipped(tokenizer):
    ids = [*tokenizer.encode("Hello", add_special_tokens=False), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert "".join(detok.update([t]) for t in ids) == "Hello"


def test_unknown_ids_beyond_the_vocabulary_decode_to_nothing(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.update([len(tokenizer) + 1000], final=True) == ""
