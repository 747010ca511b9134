"""Prefix-cache hashing: a chain over full blocks, extra keys (cache_salt) entering every hash."""

from __future__ import annotations

from inferengine.core.hashing import ROOT_HASH, BlockHasher, hash_block
from tests.core.helpers import make_request


def test_hash_block_depends_on_parent_tokens_and_extra_keys():
    base = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert base == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert len(base) == 16
    others = {
        hash_block(ROOT_HASH, [1, 2, 3, 5]),
        hash_block(ROOT_HASH, [4, 3, 2, 1]),
        hash_block(base, [1, 2, 3, 4]),
        hash_block(ROOT_HASH, [1, 2, 3, 4], ("salt",)),
        hash_block(ROOT_HASH, [1, 2, 3, 4], ("other",)),
        hash_block(ROOT_HASH, [2**40, 2, 3, 4]),
    }
    assert base not in others and len(others) == 6


def test_hasher_hashes_only_full_blocks_as_a_chain():
    request = make_request("r", list(range(10)), block_size=4)
    h0 = hash_block(ROOT_HASH, [0, 1, 2, 3])
    h1 = hash_block(h0, [4, 5, 6, 7])
    assert request.block_hashes == [h0, h1]
    request.append_output_token_ids([10])
    assert len(request.block_hashes) == 2
    request.append_output_token_ids([11])
    assert request.block_hashes == [h0, h1, hash_block(h1, [8, 9, 10, 11])]
    # Hashing again changes nothing.
    BlockHasher(4).extend(request)
    assert len(request.block_hashes) == 3


def test_equal_prefixes_share_hashes_until_they_differ():
    a = make_request("a", [1] * 8 + [2] * 4 + [3] * 4, block_size=4)
    b = make_request("b", [1] * 8 + [2] * 4 + [9] * 4, block_size=4)
    assert a.block_hashes[:3] == b.block_hashes[:3]
    assert a.block_hashes[3] != b.block_hashes[3]


def test_cache_salt_changes_every_block_hash():
    prompt = list(range(16))
    plain = make_request("p", prompt, block_size=4).block_hashes
    salted = make_request("s", prompt, block_size=4, cache_salt="alice").block_hashes
    again = make_request("t", prompt, block_size=4, cache_salt="alice").block_hashes
    other = make_request("o", prompt, block_size=4, cache_salt="bob").block_hashes
    assert salted == again
    for i in range(4):
        assert len({plain[i], salted[i], other[i]}) == 3
    assert not set(plain) & set(salted) and not set(salted) & set(other)
