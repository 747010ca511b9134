"""The FlexAttention backend against the torch reference on the same paged batches."""

import itertools
import zlib

import pytest
import torch

from inferengine.attention.backends.base import AttentionSpec
from inferengine.attention.backends.flex import (
    Q_TILE,
    FlexAttentionBackend,
    build_block_mask,
    flex_available,
    page_logical_index,
    tile_pages,
)
from inferengine.attention.backends.torch_ref import TorchAttentionBackend
from inferengine.attention.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def paged_step(
    gen, q_lens, seq_lens, *, heads, kv_heads, head_dim, block_size, shared_pages=0, padding=0
):
    """A step's inputs: shuffled pages full of finite garbage (flex multiplies masked
    probabilities by V, so NaN pages would poison even a correct kernel), new K/V for the
    query tokens, and optionally the first `shared_pages` pages shared by all sequences."""
    blocks = [-(-n // block_size) for n in seq_lens]
    num_pages = sum(blocks) + 4
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    table = torch.zeros(len(seq_lens), max(blocks) + 2, dtype=torch.int32)
    taken = shared_pages
    for i, n in enumerate(blocks):
        table[i, :shared_pages] = order[:shared_pages]
        table[i, shared_pages:n] = order[taken : taken + n - shared_pages]
        taken += n - shared_pages
    # Entries past a sequence's pages are stale: let them name pages other sequences own.
    for i, n in enumerate(blocks):
        table[i, n:] = order[torch.randint(0, taken, (table.shape[1] - n,), generator=gen)]
    kv_cache = torch.randn(2, num_pages, block_size, kv_heads, head_dim, generator=gen) * 30
    tokens = sum(q_lens) + padding
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * padding
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    return q, k, v, kv_cache, metadata


CASES = {
    "decode": ([1, 1, 1], [5, 17, 33]),
    "prefill": ([20, 7], [20, 7]),
    "mixed_with_prefix_hits": ([1, 12, 1, 9], [40, 30, 8, 25]),
    "long_chunk_over_tiles": ([300, 1], [340, 3]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_flex_matches_torch_reference(gen, case, heads, kv_heads, sliding_window):
    q_lens, seq_lens = CASES[case]
    shared = 1 if case == "mixed_with_prefix_hits" else 0
    q, k, v, kv_cache, md = paged_step(
        gen,
        q_lens,
        seq_lens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=16,
        block_size=4,
        shared_pages=shared,
        padding=3,
    )
    spec = AttentionSpec(heads, kv_heads, 16, 0.25, sliding_window)
    ref_cache = kv_cache.clone()
    expected = TorchAttentionBackend().forward(spec, q, k, v, ref_cache, md)
    actual = FlexAttentionBackend().forward(spec, q, k, v, kv_cache, md)
    n = md.num_actual_tokens
    torch.testing.assert_close(actual[:n], expected[:n], atol=2e-5, rtol=1e-4)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(kv_cache, ref_cache, atol=0, rtol=0)


def test_page_logical_index_and_tiles_exact():
    # Two sequences share page 7 at index 0; sequence 1 has a stale entry (9) past its length.
    table = torch.tensor([[7, 2, 5], [7, 3, 9]], dtype=torch.int32)
    logical = page_logical_index(table, torch.tensor([9, 6]), num_pages=10, block_size=4)
    assert logical.tolist() == [-1, -1, 1, 1, -1, 2, -1, 0, -1, -1]
    counts, indices = tile_pages(table, [0, 1, 2], [9, 6], num_pages=10, block_size=4)
    assert counts.tolist() == [[[4]]]
    assert indices[0, 0, 0, :4].tolist() == [2, 3, 5, 7]
    # A window of 3 at positions 8 and 5 sees keys 6..8 (pages 1, 2) and 3..5 (pages 0, 1).
    counts, indices = tile_pages(table, [0, 1, 2], [9, 6], 10, 4, sliding_window=3)
    assert counts.tolist() == [[[4]]]
    assert indices[0, 0, 0, :4].tolist() == [2, 3, 5, 7]
    counts, indices = tile_pages(table, [0, 1, 2], [9, 6], 10, 4, sliding_window=2)
    assert indices[0, 0, 0, : int(counts)].tolist() == [2, 3, 5]  # 7 holds keys 0..3 only


def test_long_prefill_tiles_list_only_the_pages_up_to_their_last_query():
    table = torch.arange(1, 11, dtype=torch.int32)[None]  # one sequence, 10 pages of 32
    counts, indices = tile_pages(table, [0, 300], [300], num_pages=11, block_size=32)
    # Tiles cover positions 0..127, 128..255, 256..299: pages up to 3, 7 and 9.
    assert counts.flatten().tolist() == [4, 8, 10]
    assert indices[0, 0, 0, :4].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_block_mask_lists_every_page_the_mask_admits(gen, case, sliding_window):
    """Compiled flex reads only the listed pages (eager flex ignores the list), so check the
    list itself: every (query, key) the mask admits has the key's page in the query's tile."""
    from torch.nn.attention.flex_attention import create_mask

    q_lens, seq_lens = CASES[case]
    *_, kv_cache, md = paged_step(
        gen,
        q_lens,
        seq_lens,
        heads=2,
        kv_heads=1,
        head_dim=4,
        block_size=4,
        shared_pages=1,
        padding=2,
    )
    num_pages, tokens = kv_cache.shape[1], md.slot_mapping.shape[0]
    mask = build_block_mask(md, tokens, num_pages, 4, sliding_window)
    admitted = create_mask(mask.mask_mod, 1, 1, tokens, num_pages * 4, device="cpu")[0, 0]
    counts = mask.kv_num_blocks[0, 0].tolist()
    listed = torch.zeros(len(counts), num_pages, dtype=torch.bool)
    for tile, count in enumerate(counts):
        listed[tile, mask.kv_indices[0, 0, tile, :count].long()] = True
    q, k = admitted.nonzero(as_tuple=True)
    assert len(q) > 0
    assert listed[q // Q_TILE, k // 4].all()
    # Each admitted key is one the sequence really holds: its count per query equals the
    # number of visible context positions.
    per_query = admitted.sum(dim=1)
    for i, (start, end) in enumerate(itertools.pairwise(md.query_start_loc_cpu)):
        for t in range(start, end):
            pos = seq_lens[i] - end + t
            expected = pos + 1 if sliding_window is None else min(pos + 1, sliding_window)
            assert per_query[t] == expected
    assert per_query[md.num_actual_tokens :].sum() == 0  # padding sees nothing
