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


def _pieces(tokenizer, text: str, prompt: str = "Say:") -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt, add_special_tokens=False))
    return [detok.update([t]) for t in tokenizer.encode(text, add_special_tokens=False)]


def test_byte_level_pieces_wait_exactly_for_the_bytes_they_need():
    """`café` is ca|fÃ|© (é's two bytes split); 東京 is three tokens whose middle one ends 東
    and starts 京: nothing is shown until no character is left unfinished."""
    tok = build_tokenizer()
    assert tok.convert_ids_to_tokens(tok.encode("café", add_special_tokens=False)) == [
        "ca",
        "fÃ",
        "©",
    ]
    assert _pieces(tok, "café") == ["ca", "", "fé"]
    assert _pieces(tok, "東京") == ["", "", "東京"]
    assert _pieces(tok, "🙂🙂") == ["", "", "🙂", "", "", "🙂"]


def test_a_generation_ending_mid_character_flushes_it_as_a_full_decode_would(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)[:-1]  # the last byte never comes
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.update([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == tokenizer.decode(ids) != ""
    assert pieces[-1].endswith("\ufffd")


def test_special_tokens_kept_when_asked():
    tok = build_tokenizer()
    ids = [*tok.encode("Hi", add_special_tokens=False), tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], skip_special_tokens=False)
    assert detok.update(ids, final=True) == "Hi</s>"
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    assert detok.update(ids, final=True) == "Hi"


def test_many_tokens_at_once_and_output_text_accumulates(tokenizer):
    text = "Hello world, how are you today?"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    first = detok.update(ids[:3])
    rest = detok.update(ids[3:], final=True)
    assert first + rest == detok.output_text == tokenizer.decode(ids)


def test_a_space_after_the_prompt_is_kept(tokenizer):
    """The prompt's last tokens are the context: a token that starts with a space decodes with
    it, as the whole sequence would."""
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    ids = tokenizer.encode("Hello world", add_special_tokens=False)[len(prompt) :]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(detok.update([t]) for t in ids) == " world"
