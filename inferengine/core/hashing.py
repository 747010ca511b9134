"""Prefix-cache keys: each full block is hashed as a chain, `hash(parent, tokens, extra_keys)`."""

from __future__ import annotations

import hashlib
from array import array
from typing import Protocol

BlockHash = bytes
ROOT_HASH: BlockHash = b"inferengine-root"


def hash_block(
    parent: BlockHash, token_ids: list[int], extra_keys: tuple[str, ...] = ()
) -> BlockHash:
    """A 128-bit digest of the parent hash, the block's token ids and its extra keys.

    The digest covers the whole chain, so equal hashes mean equal prefixes (up to a 2^-128
    collision chance), not only equal blocks.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    return h.digest()


def hash_prompt_blocks(
    token_ids: list[int],
    block_size: int,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
    lora_int_id: int | None = None,
) -> list[BlockHash]:
    """The chain of hashes of `token_ids`' full blocks (at most `max_blocks`), exactly as
    `BlockHasher` gives them to a request with that prompt and `cache_salt` (for a router that
    asks which replica already holds a prompt's prefix)."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hashes: list[BlockHash] = []
    parent = ROOT_HASH
    for i in range(num_blocks):
        extra = first_block_keys(cache_salt, lora_int_id) if i == 0 else ()
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


class HashedTokens(Protocol):
    """What `BlockHasher` reads and extends: a `core/request.Request`."""

    block_hashes: list[BlockHash]
    all_token_ids: list[int]
    cache_salt: str | None
    lora_int_id: int | None


def first_block_keys(cache_salt: str | None, lora_int_id: int | None) -> tuple[str, ...]:
    """The extra keys of a prompt's first block: its salt and its LoRA adapter, if any."""
    keys = (cache_salt,) if cache_salt else ()
    return (*keys, f"lora:{lora_int_id}") if lora_int_id is not None else keys


class BlockHasher:
    """Extends a request's `block_hashes` with every block that has become full."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def extend(self, request: HashedTokens) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start = len(hashes) * self.block_size
        while start + self.block_size <= len(tokens):
            parent = hashes[-1] if hashes else ROOT_HASH
            # The salt enters the first block only; the chain carries it to every later block.
            extra = () if hashes else first_block_keys(request.cache_salt, request.lora_int_id)
            hashes.append(hash_block(parent, tokens[start : start + self.block_size], extra))
            start += self.block_size
