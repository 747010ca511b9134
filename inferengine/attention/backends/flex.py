"""The FlexAttention backend: PyTorch's `flex_attention` reading K/V straight from the pages.

The whole KV cache is one long key sequence (page p holds keys `p·bs … p·bs + bs − 1`) and the
step's flattened tokens are one long query sequence. A block mask lists, for each tile of
queries, the pages of the sequences in that tile, and a mask function admits key `k` for query
`q` when k's page belongs to q's sequence and k's position in that sequence is causal for q.

Compiled (`torch.compile`) on CUDA, where only the listed pages are read; eager elsewhere, where
PyTorch evaluates the mask over every key (correct, slow, for tests and comparisons). Not captured
in CUDA graphs: building the block mask reads lengths on the host.
"""

from __future__ import annotations

from functools import cache

import torch

from inferengine.attention.backends.base import AttentionBackend, AttentionSpec
from inferengine.attention.backends.torch_ref import store_kv_torch
from inferengine.attention.metadata import AttentionMetadata

Q_TILE = 128


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _flex_fn(compiled: bool):
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    if compiled:
        return torch.compile(flex_attention, dynamic=True)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return flex_attention


def page_logical_index(
    block_table: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, block_size: int
) -> torch.Tensor:
    """int32 [num_pages]: each page's index in the block table of the sequences using it this
    step, −1 for pages no sequence uses. A page shared through the prefix cache sits at the same
    index in every table that holds it (its hash chains over all blocks before it)."""
    table = block_table.long()
    used = -(-seq_lens.long() // block_size)
    column = torch.arange(table.shape[1], device=table.device)
    valid = column[None, :] < used[:, None]
    logical = torch.full((num_pages + 1,), -1, dtype=torch.int32, device=table.device)
    pages = torch.where(valid, table, num_pages)  # invalid entries land in a spare slot
    logical[pages.flatten()] = column.expand_as(table).flatten().to(torch.int32)
    return logical[:num_pages]


def tile_pages(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    starts: list[int],
    num_tokens: int,
    num_pages: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of `Q_TILE` query tokens, how many pages and which: the union of the pages of
    every sequence with queries in the tile, each page once, listed first in a row as wide as
    the cache (BlockMask's layout)."""
    num_tiles = max(1, -(-num_tokens // Q_TILE))
    tile_ids, seq_ids = [], []
    for i in range(len(starts) - 1):
        if starts[i + 1] > starts[i]:
            first, last = starts[i] // Q_TILE, (starts[i + 1] - 1) // Q_TILE
            tile_ids.extend(range(first, last + 1))
            seq_ids.extend([i] * (last - first + 1))
    device = block_table.device
    needed = torch.zeros(num_tiles, num_pages + 1, dtype=torch.bool, device=device)
    if tile_ids:
        seqs = torch.tensor(seq_ids, device=device)
        tiles = torch.tensor(tile_ids, device=device)
        table = block_table[seqs].long()
        used = -(-seq_lens[seqs].long() // block_size)
        column = torch.arange(table.shape[1], device=device)
        pages = torch.where(column[None, :] < used[:, None], table, num_pages)
        needed[tiles[:, None].expand_as(pages), pages] = True
    needed = needed[:, :num_pages]
    counts = needed.sum(dim=1, dtype=torch.int32)
    order = torch.argsort(needed.to(torch.int8), dim=1, descending=True, stable=True)
    return counts[None, None], order.to(torch.int32)[None, None]


class FlexAttentionBackend(AttentionBackend):
    name = "flex"

    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import BlockMask

        store_kv_torch(key, value, kv_cache, metadata.slot_mapping)
        _, num_pages, block_size, num_kv_heads, head_dim = kv_cache.shape
        starts = metadata.query_start_loc_cpu or metadata.query_start_loc.tolist()
        compiled = query.is_cuda
        if not compiled:
            # Eager flex materialises scores against every key: stop at the last page in use.
            num_pages = int(metadata.block_table.max()) + 1 if metadata.num_seqs else 1
        num_tokens = query.shape[0]
        seq_lens = metadata.seq_lens.long()
        qsl = metadata.query_start_loc.long()
        token = torch.arange(num_tokens, device=query.device)
        seq_of_token = torch.searchsorted(qsl[1:], token, right=True).clamp_(max=len(seq_lens) - 1)
        position = seq_lens[seq_of_token] - qsl[seq_of_token + 1] + token
        position = torch.where(token < metadata.num_actual_tokens, position, -1)  # padding
        logical = page_logical_index(metadata.block_table, seq_lens, num_pages, block_size)
        table = metadata.block_table.long()
        window = spec.sliding_window

        def mask_mod(b, h, q_idx, kv_idx):
            page = kv_idx // block_size
            index = logical[page]
            seq = seq_of_token[q_idx]
            owned = (index >= 0) & (table[seq, index.clamp(min=0)] == page)
            k_pos = index * block_size + kv_idx % block_size
            q_pos = position[q_idx]
            keep = owned & (k_pos <= q_pos)
            if window is not None:
                keep = keep & (k_pos > q_pos - window)
            return keep

        counts, indices = tile_pages(
            metadata.block_table, metadata.seq_lens, starts, num_tokens, num_pages, block_size
        )
        kv_len = num_pages * block_size
        block_mask = BlockMask.from_kv_blocks(
            counts,
            indices,
            BLOCK_SIZE=(Q_TILE, block_size),
            mask_mod=mask_mod,
            seq_lengths=(num_tokens, kv_len),
        )
        q = query.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        kv = kv_cache[:, :num_pages].reshape(2, kv_len, num_kv_heads, head_dim)
        k = kv[0].transpose(0, 1).unsqueeze(0)  # [1, Hkv, pages·bs, D]
        v = kv[1].transpose(0, 1).unsqueeze(0)
        # Compiled tiles must divide the mask's tiles: one page of keys per BLOCK_N. The generic
        # kernel, not flex's decoding kernel, since a step mixes decodes and prefill chunks.
        options = (
            {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 64, "BLOCK_N": block_size}
            if compiled
            else None
        )
        out = _flex_fn(compiled)(
            q,
            k,
            v,
            block_mask=block_mask,
            scale=spec.scale,
            enable_gqa=spec.num_heads != num_kv_heads,
            kernel_options=options,
        )
        return out[0].transpose(0, 1).contiguous()
