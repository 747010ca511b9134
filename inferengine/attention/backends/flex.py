"""The FlexAttention backend: PyTorch's `flex_attention` reading K/V straight from the pages.

The whole KV cache is one long key sequence (page p holds keys `p·bs … p·bs + bs − 1`) and the
step's flattened tokens are one long query sequence. A block mask lists, for each tile of
`Q_TILE` queries, the pages its sequences can see, and a mask function admits key `k` for query
`q` when k's page belongs to q's sequence and k's position in that sequence is causal for q (and
inside the sliding window). The block mask is built once per step and shared by all layers.
Logit soft-capping (Gemma 2) is a score modifier: cap · tanh(score / cap) on the scaled scores.

Compiled (`torch.compile`) on CUDA, where only the listed pages are read; eager elsewhere, where
PyTorch evaluates the mask over every key (correct, slow: for tests and comparisons). Not captured
in CUDA graphs: building the block mask reads lengths on the host. Decodes share query tiles, so
each decode query scans the pages of every sequence in its tile: this backend suits prefill-heavy
steps better than large decode batches. An fp8 KV cache is read dequantized, on the CPU only:
on CUDA that would dequantize the whole cache in every layer, so it is refused.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch

from inferengine.attention.backends.base import AttentionBackend, AttentionSpec, RotaryInputs
from inferengine.attention.backends.torch_ref import store_kv_torch
from inferengine.attention.metadata import AttentionMetadata
from inferengine.errors import ConfigError
from inferengine.kernels.kv_quant import dequantize, is_fp8

Q_TILE = 128


@cache
def _from_kv_blocks_params() -> frozenset[str]:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(BlockMask.from_kv_blocks).parameters)


def flex_available() -> bool:
    """FlexAttention with block masks of explicit sequence lengths (torch ≥ 2.6)."""
    return "seq_lengths" in _from_kv_blocks_params()


@cache
def _flex_fn(compiled: bool):
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    if compiled:
        return torch.compile(flex_attention, dynamic=True)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return flex_attention


@cache
def soft_cap_score_mod(cap: float):
    """flex's score modifier for logit soft-capping, one function per cap value (so compiled
    flex sees the same function in every layer and step)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


def page_logical_index(
    block_table: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, block_size: int
) -> torch.Tensor:
    """int32 [num_pages]: each page's index in the block tables of the sequences using it this
    step, −1 for pages no sequence uses. A page shared through the prefix cache sits at the same
    index in every table that holds it, because its hash chains over all the blocks before it."""
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
    starts: list[int],
    seq_lens: list[int],
    num_pages: int,
    block_size: int,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of `Q_TILE` query tokens, how many pages and which, in BlockMask's layout
    ([1, 1, tiles] and [1, 1, tiles, num_pages], listed pages first): each sequence with queries
    in the tile contributes the pages its queries there can see (up to the last query's position,
    and not wholly before the first one's window), each page once."""
    num_tokens = starts[-1]
    num_tiles = max(1, -(-num_tokens // Q_TILE))
    tiles, seqs, first_page, end_page = [], [], [], []
    for i, seq_len in enumerate(seq_lens):
        lo, hi = starts[i], starts[i + 1]
        for tile in range(lo // Q_TILE, -(-hi // Q_TILE)):
            tok_lo, tok_hi = max(lo, tile * Q_TILE), min(hi, (tile + 1) * Q_TILE) - 1
            pos_lo, pos_hi = seq_len - hi + tok_lo, seq_len - hi + tok_hi
            start = 0 if sliding_window is None else max(0, pos_lo - sliding_window + 1)
            tiles.append(tile)
            seqs.append(i)
            first_page.append(start // block_size)
            end_page.append(pos_hi // block_size + 1)
    device = block_table.device
    needed = torch.zeros(num_tiles, num_pages + 1, dtype=torch.bool, device=device)
    if tiles:

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        tile_ids, seq_ids = as_tensor(tiles), as_tensor(seqs)
        table = block_table[seq_ids].long()
        column = torch.arange(table.shape[1], device=device)
        visible = (column >= as_tensor(first_page)[:, None]) & (
            column < as_tensor(end_page)[:, None]
        )
        pages = torch.where(visible, table, num_pages)  # hidden entries land in a spare column
        needed[tile_ids[:, None].expand_as(pages), pages] = True
    needed = needed[:, :num_pages]
    counts = needed.sum(dim=1, dtype=torch.int32)
    order = torch.argsort(needed.to(torch.int8), dim=1, descending=True, stable=True)
    return counts[None, None], order.to(torch.int32)[None, None]


def build_block_mask(
    metadata: AttentionMetadata,
    num_tokens: int,
    num_pages: int,
    block_size: int,
    sliding_window: int | None,
):
    from torch.nn.attention.flex_attention import BlockMask

    starts = metadata.query_start_loc_cpu or metadata.query_start_loc.tolist()
    seq_lens_cpu = metadata.seq_lens_cpu or metadata.seq_lens.tolist()
    seq_lens = metadata.seq_lens.long()
    qsl = metadata.query_start_loc.long()
    token = torch.arange(num_tokens, device=qsl.device)
    seq_of_token = torch.searchsorted(qsl[1:], token, right=True).clamp_(max=len(seq_lens) - 1)
    position = seq_lens[seq_of_token] - qsl[seq_of_token + 1] + token
    position = torch.where(token < metadata.num_actual_tokens, position, -1)  # padding: no keys
    logical = page_logical_index(metadata.block_table, seq_lens, num_pages, block_size)
    table = metadata.block_table.long()

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // block_size
        index = logical[page]
        # A table entry past a sequence's pages may name any page; the position test below
        # rejects it, since such an entry's positions all lie beyond the sequence's end.
        owned = (index >= 0) & (table[seq_of_token[q_idx], index.clamp(min=0)] == page)
        k_pos = index * block_size + kv_idx % block_size
        q_pos = position[q_idx]
        keep = owned & (k_pos <= q_pos)
        if sliding_window is not None:
            keep = keep & (k_pos > q_pos - sliding_window)
        return keep

    counts, indices = tile_pages(
        metadata.block_table, starts, seq_lens_cpu, num_pages, block_size, sliding_window
    )
    extra = {"compute_q_blocks": False} if "compute_q_blocks" in _from_kv_blocks_params() else {}
    return BlockMask.from_kv_blocks(
        counts,
        indices,
        BLOCK_SIZE=(Q_TILE, block_size),
        mask_mod=mask_mod,
        seq_lengths=(num_tokens, num_pages * block_size),
        **extra,
    )


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
        rotary: RotaryInputs | None = None,
    ) -> torch.Tensor:
        store_kv_torch(key, value, kv_cache, metadata.slot_mapping, spec.k_scale, spec.v_scale)
        _, num_pages, block_size, num_kv_heads, head_dim = kv_cache.shape
        compiled = query.is_cuda
        if compiled and is_fp8(kv_cache.dtype):
            raise ConfigError(
                "--attention-backend flex cannot read an fp8 KV cache on CUDA (it would "
                "dequantize the whole cache in every layer); use --attention-backend triton or "
                "auto, or --kv-cache-dtype auto."
            )
        if compiled and block_size < 16:
            raise ConfigError(
                f"--attention-backend flex on CUDA needs --block-size 16 or more (got {block_size})."
            )
        if not compiled:
            # Eager flex materialises scores against every key: stop at the last page in use.
            num_pages = int(metadata.block_table.max()) + 1 if metadata.num_seqs else 1
        num_tokens = query.shape[0]
        key_ = ("flex_block_mask", num_tokens, num_pages, block_size, spec.sliding_window)
        block_mask = metadata.per_step.get(key_)
        if block_mask is None:
            block_mask = build_block_mask(
                metadata, num_tokens, num_pages, block_size, spec.sliding_window
            )
            metadata.per_step[key_] = block_mask
        kv_len = num_pages * block_size
        q = query.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        kv = kv_cache[:, :num_pages].reshape(2, kv_len, num_kv_heads, head_dim)
        k = dequantize(kv[0], spec.k_scale, query.dtype).transpose(0, 1).unsqueeze(0)
        v = dequantize(kv[1], spec.v_scale, query.dtype).transpose(0, 1).unsqueeze(0)
        # Compiled key tiles must divide a page. The generic kernel, not flex's decoding kernel,
        # since a step mixes decodes and prefill chunks.
        options = (
            {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 64, "BLOCK_N": min(block_size, 64)}
            if compiled
            else None
        )
        out = _flex_fn(compiled)(
            q,
            k,
            v,
            block_mask=block_mask,
            score_mod=soft_cap_score_mod(spec.logits_soft_cap) if spec.logits_soft_cap else None,
            scale=spec.scale,
            enable_gqa=spec.num_heads != num_kv_heads,
            kernel_options=options,
        )
        return out[0].transpose(0, 1).contiguous()
