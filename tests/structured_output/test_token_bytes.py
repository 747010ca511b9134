"""The token table built from decoded bytes: on tokenizers llguidance's importer reads, it
equals the importer's id by id (bytes and specialness, partial UTF-8 and byte-fallback pieces
included); on one it refuses (a bare `Fuse` decoder, a `Metaspace` one), `make_tokenizer`
still gives a tokenizer whose masks keep JSON-schema and regex output valid."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from inferengine.structured_output.grammar import make_tokenizer
from inferengine.structured_output.token_bytes import tokenizer_from_bytes
from tests.conftest import build_tokenizer

CORPUS = [
    'The quick brown fox jumps over the lazy dog. {"name": "Ann", "age": 41, "tags": []}',
    "Paris is the capital of France. Zürich, café, naïve — unicode text 東京 🙂.",
] * 40
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SPECIALS = ["<s>", "</s>", "<unk>"]
EOS = 1


def fuse_tokenizer(vocab_size: int = 200) -> PreTrainedTokenizerFast:
    """Character-level BPE over printable ASCII whose decoder is a bare `Fuse`: a valid fast
    tokenizer (text round-trips) that llguidance's importer does not know."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    alphabet = [chr(c) for c in range(32, 127)] + ["\n"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = [chr(c) for c in range(33, 127)]
    trainer = trainers.BpeTrainer(
        vocab_size=250, special_tokens=SPECIALS, initial_alphabet=alphabet
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2-like: `▁` for spaces, `<0xAB>` byte pieces, a decoder llguidance knows."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte pieces in the model's vocabulary, as Llama 2 has them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def _table(tokenizer, n: int) -> list[tuple[bytes, bool]]:
    return [(tokenizer.decode_bytes([t]), tokenizer.is_special_token(t)) for t in range(n)]


@pytest.mark.parametrize("build", [build_tokenizer, _byte_fallback_tokenizer])
def test_the_table_equals_llguidances_importer_where_the_importer_works(build):
    hf = build()
    n = len(hf) + 5  # ids past the tokenizer (a model's padded vocabulary)
    ours = tokenizer_from_bytes(hf, n, [hf.eos_token_id])
    theirs = llguidance.hf.from_tokenizer(hf, n_vocab=n, eos_token=[hf.eos_token_id])
    assert ours.vocab_size == theirs.vocab_size == n
    assert _table(ours, n) == _table(theirs, n)
    partial = [t for t in range(len(hf)) if _table(ours, t + 1)[t][0][-1:] >= b"\x80"]
    assert partial  # some tokens end inside a UTF-8 character, and still match
    assert ours.eos_tokens == theirs.eos_tokens == [hf.eos_token_id]


def test_llguidances_importer_refuses_fuse_and_metaspace_decoders():
    for hf, name in ((fuse_tokenizer(), "Fuse"), (_metaspace_tokenizer(), "Metaspace")):
        with pytest.raises(ValueError, match=f"can't determine decoder type.*{name}"):
            llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=EOS)


def test_each_token_of_a_fuse_tokenizer_is_its_decoded_text():
    hf = fuse_tokenizer()
    ll = make_tokenizer(hf, len(hf) + 3, [EOS])
    assert ll.vocab_size == len(hf) + 3
    for t in range(len(SPECIALS), len(hf)):
        assert ll.decode_bytes([t]) == hf.decode([t]).encode()
        assert not ll.is_special_token(t)
    assert [ll.is_special_token(t) for t in range(len(SPECIALS))] == [True] * 3
    assert ll.eos_tokens == [EOS]
    text = '{"name": "Ann", "age": 41}'
    assert ll.tokenize_str(text) == hf.encode(text, add_special_tokens=False)


def test_metaspace_tokens_carry_their_space():
    hf = _metaspace_tokenizer()
    ll = make_tokenizer(hf, len(hf), [EOS])
    ids = hf.encode("the lazy dog", add_special_tokens=False)
    assert ll.decode_bytes(ids) == b" the lazy dog"  # the decoder drops only the first space


def _random_walk(ll, grammar: str, seed: int, max_tokens: int = 80) -> tuple[str, bool]:
    """Sample uniformly among the tokens the mask allows until the grammar stops."""
    rng = random.Random(seed)
    matcher = llguidance.LLMatcher(ll, grammar)
    assert not matcher.is_error(), matcher.get_error()
    mask = np.zeros((1, (ll.vocab_size + 31) // 32), np.int32)
    tokens = []
    for _ in range(max_tokens):
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: ll.vocab_size]
        token = rng.choice(np.flatnonzero(bits).tolist())
        assert matcher.consume_token(token)
        if token not in ll.eos_tokens:
            tokens.append(token)
        if matcher.is_stopped():
            return ll.decode_bytes(tokens).decode(), True
    return ll.decode_bytes(tokens).decode(), False


def test_json_schema_and_regex_hold_through_a_fuse_tokenizer():
    hf = fuse_tokenizer()
    ll = make_tokenizer(hf, len(hf), [EOS])
    compact = {"whitespace_flexible": False}
    schema = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=compact)
    finished = 0
    for seed in range(20):
        text, done = _random_walk(ll, schema, seed)
        if done:
            finished += 1
            jsonschema.validate(json.loads(text), SCHEMA)
            assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
    assert finished >= 15
    regex = llguidance.grammar_from("regex", r"[a-z]{3}-[0-9]{2}")
    for seed in range(10):
        text, done = _random_walk(ll, regex, seed)
        assert done and re.fullmatch(r"[a-z]{3}-[0-9]{2}", text)
