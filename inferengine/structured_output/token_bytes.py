"""llguidance's token table from the tokenizer's own decoded bytes, for tokenizers whose
`tokenizer.json` llguidance's importer cannot read (a decoder it does not know, such as a bare
`Fuse`, or a slow tokenizer).

Like xgrammar's decoded vocabulary: each token's bytes are what the tokenizer decodes it to,
after a fixed prefix token, so decoders that drop a leading space on the first token (Metaspace,
WordPiece) still give the space the token carries in running text. A token the decode cannot
give whole bytes for (part of a UTF-8 character) takes them from its piece: `<0xAB>` (byte
fallback) or GPT-2's byte-level alphabet. A token whose bytes stay unknown gets none, and
llguidance never allows an empty token. Special tokens are marked (llguidance's 0xFF prefix),
so grammar text never spells one; every id that ends a request is an end token.
"""

from __future__ import annotations

import re
from typing import Any

SPECIAL_MARKER = b"\xff"  # llguidance (toktrie) marks special tokens with this first byte
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map of printable characters back to the bytes they stand for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def special_token_ids(hf_tokenizer: Any) -> set[int]:
    """Ids the tokenizer treats as special: its named specials and added tokens marked special."""
    ids = {int(i) for i in getattr(hf_tokenizer, "all_special_ids", []) if i is not None}
    for token_id, added in getattr(hf_tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


class _Decoder:
    """Decodes id lists the way the detokenizer does (no clean-up of spaces)."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self.backend = getattr(hf_tokenizer, "backend_tokenizer", None)

    def batch(self, sequences: list[list[int]]) -> list[str]:
        if self.backend is not None:
            return self.backend.decode_batch(sequences, skip_special_tokens=False)
        return [
            self.hf.decode(s, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for s in sequences
        ]


def _prefix_token(decoder: _Decoder, candidates: list[int]) -> tuple[int, str] | None:
    """A token that decodes to the same non-blank text first or second in a row, to put before
    each token so the token decodes as in running text."""
    for token_id in candidates:
        alone, twice = decoder.batch([[token_id], [token_id, token_id]])
        stable = twice.startswith(alone) and twice.endswith(alone) and len(twice) > len(alone)
        if alone and alone.strip() == alone and "\ufffd" not in alone and stable:
            return token_id, alone
    return None


def _piece_bytes(piece: str | None) -> bytes | None:
    """A partial-character token's bytes from its piece, if the piece spells them."""
    if not piece:
        return None
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    if all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None


def token_bytes(hf_tokenizer: Any, n_vocab: int) -> list[bytes]:
    """Each id's bytes, for ids `0 .. n_vocab - 1`; ids past the tokenizer's are special tokens
    named `<[id]>`, as llguidance's own importer names them."""
    size = min(len(hf_tokenizer), n_vocab)
    special = special_token_ids(hf_tokenizer)
    pieces = hf_tokenizer.convert_ids_to_tokens(list(range(size)))
    decoder = _Decoder(hf_tokenizer)
    plain = [t for t in range(size) if t not in special and pieces[t] is not None]
    prefix = _prefix_token(decoder, [t for t in plain if pieces[t] and pieces[t].isalnum()][:64])
    if prefix is None:
        texts = decoder.batch([[t] for t in plain])
        lead = ""
    else:
        texts = decoder.batch([[prefix[0], t] for t in plain])
        lead = prefix[1]
    table = [SPECIAL_MARKER + f"<[{t}]>".encode() for t in range(n_vocab)]
    for t, text in zip(plain, texts, strict=True):
        byte = _BYTE_PIECE.fullmatch(pieces[t] or "")
        if byte:
            table[t] = bytes([int(byte.group(1), 16)])
        elif text.startswith(lead) and "\ufffd" not in text[len(lead) :]:
            table[t] = text[len(lead) :].encode()
        else:
            table[t] = _piece_bytes(pieces[t]) or b""
    for t in special:
        if t < size and pieces[t]:
            table[t] = SPECIAL_MARKER + pieces[t].encode()
    return table


class _TokenTable:
    """What `llguidance.TokenizerWrapper` reads: the table, special and end ids, and a
    callable that tokenizes text (llguidance uses it for forced and healed text)."""

    def __init__(self, hf_tokenizer: Any, n_vocab: int, eos_token_ids: list[int]):
        self.hf = hf_tokenizer
        self.tokens = token_bytes(hf_tokenizer, n_vocab)
        self.special_token_ids = [t for t, b in enumerate(self.tokens) if b[:1] == SPECIAL_MARKER]
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else hf_tokenizer.eos_token_id
        self.bos_token_id = getattr(hf_tokenizer, "bos_token_id", None)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # the wrapper then hands us str only
            raise TypeError("text, not bytes")
        return list(self.hf.encode(text, add_special_tokens=False))


def tokenizer_from_bytes(hf_tokenizer: Any, n_vocab: int, eos_token_ids: list[int]) -> Any:
    """An `llguidance.LLTokenizer` over `n_vocab` ids, from decoded token bytes."""
    import llguidance

    table = _TokenTable(hf_tokenizer, n_vocab, eos_token_ids)
    wrapper = llguidance.TokenizerWrapper(table)
    return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos_token_ids or None)
