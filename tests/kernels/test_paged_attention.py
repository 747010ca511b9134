"""Paged attention kernel against its torch reference, at interpreter-sized shapes."""

import pytest
import torch

from inferengine.kernels import paged_attention as pa

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def check(batch, assert_close, *, max_query_len=None, max_seq_len=None, **kwargs) -> None:
    """Run kernel (into a NaN-poisoned output) and reference on `batch`, compare them."""
    head_dim = batch.q.shape[-1]
    window = kwargs.pop("sliding_window", None)
    cap = kwargs.pop("soft_cap", None)
    bounds = {
        "max_query_len": max_query_len or batch.max_query_len,
        "max_seq_len": max_seq_len or batch.max_seq_len,
    }
    out = torch.full_like(batch.q, float("nan"))
    pa.paged_attention(
        *batch.args(), **bounds, scale=head_dim**-0.5, sliding_window=window, soft_cap=cap,
        out=out, **kwargs,
    )  # fmt: skip
    expected = pa.paged_attention_ref(
        *batch.args(), scale=head_dim**-0.5, sliding_window=window, soft_cap=cap
    )
    assert_close(out, expected)


# (query heads, KV heads, head dim, block size, dtype): GQA 1/2/4/8, both block sizes, both
# main head dims, each dtype, without running the full product in the interpreter.
SHAPES = [
    (2, 2, 64, 16, F32),
    (4, 2, 128, 32, BF16),
    (8, 2, 64, 32, F16),
    (4, 1, 128, 16, F32),
    (8, 1, 64, 16, BF16),
]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size", "dtype"), SHAPES)
def test_decode(paged_batch, assert_close, hq, hkv, head_dim, block_size, dtype, num_splits):
    seq_lens = [1, 17, 64, 150]
    batch = paged_batch(
        [1] * 4, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    check(batch, assert_close, num_splits=num_splits)


def test_split_merge_in_its_own_kernel_matches(paged_batch, assert_close):
    """The separate merge kernel (taken when arrival counters cannot be allocated, as inside a
    graph capture that outgrew them) gives the reference result too; the counters end at 0."""
    from inferengine.kernels.triton_utils import arrival_counters

    batch = paged_batch(
        [1, 1, 2], [40, 150, 77], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=F32,
    )  # fmt: skip
    check(batch, assert_close, num_splits=4, fused_merge=False)
    check(batch, assert_close, num_splits=4, fused_merge=True)
    assert int(arrival_counters(batch.q.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("heads_per_tile", [1, 2])
def test_prefill_with_part_of_the_group_per_tile(paged_batch, assert_close, heads_per_tile):
    batch = paged_batch(
        [1, 40, 7], [30, 90, 7], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=BF16,
    )  # fmt: skip
    cfg = pa.TileConfig(32, 16, 4, 2, heads_per_tile=heads_per_tile)
    check(batch, assert_close, prefill_config=cfg)


@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size", "dtype"), SHAPES)
def test_prefill(paged_batch, assert_close, hq, hkv, head_dim, block_size, dtype):
    lens = [1, 33, 100]
    batch = paged_batch(
        lens, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    check(batch, assert_close)


# Decodes, a fresh prompt, a prefix hit / chunk that starts mid-block, one that starts on a block
# boundary, and an idle sequence with no queries (as a padded batch slot may be).
MIXED_Q = [1, 37, 1, 20, 16, 0, 1]
MIXED_SEQ = [45, 37, 130, 90, 48, 5, 2]


@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size", "dtype"), SHAPES)
def test_mixed_batch(paged_batch, assert_close, hq, hkv, head_dim, block_size, dtype):
    batch = paged_batch(
        MIXED_Q, MIXED_SEQ, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    check(batch, assert_close, num_splits=2)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_upper_bounds_give_same_result(paged_batch, assert_close, dtype):
    """A CUDA graph captures with bounds, not the step's true maxima."""
    batch = paged_batch(
        MIXED_Q, MIXED_SEQ, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    check(batch, assert_close, max_query_len=256, max_seq_len=4096)
    decode = paged_batch([1, 1, 1], [3, 40, 77], num_q_heads=4, num_kv_heads=2, head_dim=64,
                         block_size=16, dtype=dtype)  # fmt: skip
    check(decode, assert_close, max_query_len=1, max_seq_len=4096)


@pytest.mark.parametrize("max_query_len", [3, 40])
def test_short_queries_on_split_path(paged_batch, assert_close, max_query_len):
    """Speculative-decoding shape: a few queries per sequence over a longer context; with a
    large bound the same batch goes down the prefill path instead."""
    batch = paged_batch(
        [3, 2, 1, 3], [3, 50, 81, 120], num_q_heads=4, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=F32,
    )  # fmt: skip
    check(batch, assert_close, max_query_len=max_query_len, num_splits=3)


@pytest.mark.parametrize("window", [1, 24, 1000])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_sliding_window(paged_batch, assert_close, window, num_splits):
    batch = paged_batch(
        MIXED_Q, MIXED_SEQ, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=F32,
    )  # fmt: skip
    check(batch, assert_close, sliding_window=window, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_long_context_many_blocks(paged_batch, assert_close, dtype):
    """A few hundred tokens over dozens of shuffled pages: decode with many splits, a chunk
    continuing a long prefix, and a window over it."""
    batch = paged_batch(
        [1, 48, 1], [700, 600, 333], num_q_heads=2, num_kv_heads=1, head_dim=32,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    check(batch, assert_close, num_splits=7)
    # A window much wider than a key tile but narrower than the context: mask-free middle tiles.
    check(batch, assert_close, sliding_window=300, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_query_without_context_gives_zeros(paged_batch, assert_close, num_splits):
    """A padded slot may carry one query and seq_len 0: finite zeros, not NaN."""
    batch = paged_batch(
        [1, 1, 1], [30, 0, 1], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=F32,
    )  # fmt: skip
    check(batch, assert_close, num_splits=num_splits)


@pytest.mark.parametrize("head_dim", [32, 96])
def test_other_head_dims(paged_batch, assert_close, head_dim):
    batch = paged_batch(
        MIXED_Q, MIXED_SEQ, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16,
        dtype=F32,
    )  # fmt: skip
    check(batch, assert_close, num_splits=2)


def test_default_plan_and_strided_views(paged_batch, assert_close):
    """The public call with its own split plan; q and out as head slices of wider rows."""
    batch = paged_batch(
        [1, 1, 9], [300, 64, 20], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=32,
        dtype=F32,
    )  # fmt: skip
    qkv = torch.randn(batch.q.shape[0], 8, 64, dtype=F32, device=batch.q.device)
    qkv[:, :4] = batch.q
    wide_out = torch.full((batch.q.shape[0], 6, 64), float("nan"), device=batch.q.device)
    out = pa.paged_attention(
        qkv[:, :4], batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, scale=0.125,
        out=wide_out[:, 1:5],
    )  # fmt: skip
    assert out.data_ptr() == wide_out[:, 1:5].data_ptr()
    assert wide_out[:, 0].isnan().all() and wide_out[:, 5].isnan().all()
    assert_close(out, pa.paged_attention_ref(*batch.args(), scale=0.125))
    fresh = pa.paged_attention(
        *batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        scale=0.125,
    )  # fmt: skip
    assert_close(fresh, out)


def test_num_kv_splits_fills_the_device():
    assert pa.num_kv_splits(256, 8, 32768, sms=132) == 1
    assert pa.num_kv_splits(1, 4, 32768, sms=132) * 4 >= 2 * 132
    assert pa.num_kv_splits(1, 4, 100, sms=132) == 1
    assert 1 <= pa.num_kv_splits(64, 4, 4096, sms=132) <= 4096 // pa.SPLIT_MIN_TOKENS
    assert pa.num_kv_splits(1, 1, 10**7, sms=10**4) == pa.MAX_SPLITS


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_graph_padding_leaves_real_rows_alone(paged_batch, assert_close, dtype):
    """A CUDA graph pads a step: trailing sequences with no queries and no context, and trailing
    tokens that belong to no sequence. The real rows come out as without padding."""
    batch = paged_batch(
        MIXED_Q, MIXED_SEQ, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    real_tokens, real_seqs = batch.q.shape[0], len(MIXED_Q)
    pad_tokens, pad_seqs = 13, 5
    dev = batch.q.device
    q = torch.cat([batch.q, torch.randn(pad_tokens, *batch.q.shape[1:]).to(dev, dtype)])
    qsl = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:].repeat(pad_seqs)])
    seq_lens = torch.cat([batch.seq_lens, torch.zeros(pad_seqs, dtype=torch.int32, device=dev)])
    table = torch.cat([batch.block_table, torch.zeros_like(batch.block_table[:pad_seqs])])
    out = torch.full_like(q, float("nan"))
    pa.paged_attention(
        q, batch.kv_cache, qsl, seq_lens, table, max_query_len=q.shape[0], max_seq_len=4096,
        scale=64**-0.5, out=out,
    )  # fmt: skip
    expected = pa.paged_attention_ref(*batch.args(), scale=64**-0.5)
    assert_close(out[:real_tokens], expected)
    assert real_seqs + pad_seqs == seq_lens.shape[0]


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_padded_tokens_with_every_sequence_slot_real(paged_batch, assert_close, dtype):
    """A full batch (every sequence slot a real request, as when max_num_seqs requests run) in a
    mixed graph padded with tokens only: the prefill tiles past the last sequence's own belong to
    nobody and must write nothing, inside `out` or before it."""
    batch = paged_batch(
        [1, 1, 1, 9], [3, 66, 18, 9], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    real, pad = batch.q.shape[0], 52
    dev = batch.q.device
    q = torch.cat([batch.q, torch.randn(pad, *batch.q.shape[1:]).to(dev, dtype)])
    # `out` sits in the middle of a NaN-filled buffer: a write before or after it shows there.
    guard = torch.full((3 * q.shape[0], *q.shape[1:]), float("nan"), dtype=dtype, device=dev)
    out = guard[q.shape[0] : 2 * q.shape[0]]
    pa.paged_attention(
        q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        max_query_len=q.shape[0], max_seq_len=512, scale=64**-0.5, out=out,
    )  # fmt: skip
    assert guard[: q.shape[0]].isnan().all() and guard[2 * q.shape[0] :].isnan().all()
    assert_close(out[:real], pa.paged_attention_ref(*batch.args(), scale=64**-0.5))


def fresh_kv(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token's own key and value, read back from its cache slot, as rows of one
    fused [T, Hq + 2 Hkv, D] buffer (the layout the model's QKV projection gives)."""
    block_size = batch.kv_cache.shape[2]
    hq, hkv = batch.q.shape[1], batch.kv_cache.shape[3]
    qkv = torch.zeros(batch.q.shape[0], hq + 2 * hkv, batch.q.shape[2], dtype=batch.q.dtype)
    qkv = qkv.to(batch.q.device)
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        for t in range(starts[i], starts[i + 1]):
            pos = seq_len - (starts[i + 1] - t)
            block = int(batch.block_table[i, pos // block_size])
            qkv[t, hq : hq + hkv] = batch.kv_cache[0, block, pos % block_size]
            qkv[t, hq + hkv :] = batch.kv_cache[1, block, pos % block_size]
    return qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]


def padded_fresh_kv(batch, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`batch.q` with `pad` trailing tokens that belong to no sequence (a CUDA graph's padding),
    and fresh K/V whose padding rows are NaN: their values come from attention output rows no
    kernel writes, so they can be anything."""
    key, value = fresh_kv(batch)
    real, hq, head_dim = batch.q.shape
    hkv = key.shape[1]
    dev, dtype = batch.q.device, batch.q.dtype
    q = torch.cat([batch.q, torch.randn(pad, hq, head_dim).to(dev, dtype)])
    qkv = torch.full((real + pad, hq + 2 * hkv, head_dim), float("nan"), dtype=dtype, device=dev)
    qkv[:real, hq : hq + hkv] = key
    qkv[:real, hq + hkv :] = value
    return q, qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]


@pytest.mark.parametrize("fresh_tma", [None, False])
def test_chunk_next_to_nan_padding_rows(paged_batch, assert_close, fresh_tma):
    """A prefix hit's short chunk, last in a padded step: its last key tile runs past its own
    rows into the padding rows, NaN there included. Masked keys must add nothing (0 · NaN is
    NaN in P @ V): the chunk comes out as without padding (the JSON-after-prefix-hit bug)."""
    batch = paged_batch(
        [1, 10], [300, 346], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=BF16,
    )  # fmt: skip
    real = batch.q.shape[0]
    q, key, value = padded_fresh_kv(batch, 64 - real)
    out = torch.full_like(q, float("nan"))
    pa.paged_attention(
        q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        max_query_len=q.shape[0], max_seq_len=512, scale=64**-0.5, out=out, fresh_key=key,
        fresh_value=value, fresh_tma=fresh_tma,
    )  # fmt: skip
    assert_close(out[:real], pa.paged_attention_ref(*batch.args(), scale=64**-0.5))


@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size", "dtype"), SHAPES)
def test_chunk_keys_read_from_the_fresh_kv(
    paged_batch, assert_close, hq, hkv, head_dim, block_size, dtype
):
    """Prefill tiles that read the chunk's own keys from the step's K/V rows (and the context
    before it from the pages) match the reference: fresh prompts, prefix hits, chunks starting
    mid-block, decodes beside them."""
    batch = paged_batch(
        MIXED_Q, MIXED_SEQ, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    key, value = fresh_kv(batch)
    check(batch, assert_close, fresh_key=key, fresh_value=value)
    cfg = pa.TileConfig(32, 16, 4, 2, heads_per_tile=1)
    check(batch, assert_close, fresh_key=key, fresh_value=value, prefill_config=cfg)


def test_prefill_only_batch_skips_the_decode_launch(paged_batch, assert_close):
    """With min_query_len above the split path's limit only the prefill launch runs, and the
    result is the same."""
    batch = paged_batch(
        [40, 33], [90, 33], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=BF16,
    )  # fmt: skip
    check(batch, assert_close, min_query_len=33)


# Every head dim real models use beside the test ones (8, 16, 32), each with another GQA shape:
# MQA, groups 1 to 16, a group that is not a power of two.
HEAD_DIM_SHAPES = [
    (4, 1, 8, F32),
    (16, 1, 16, BF16),
    (6, 2, 32, F16),
    (5, 5, 80, BF16),
    (12, 4, 96, F32),
    (8, 1, 112, BF16),
    (16, 2, 192, F32),
    (4, 2, 256, BF16),
]


@pytest.mark.parametrize(("hq", "hkv", "head_dim", "dtype"), HEAD_DIM_SHAPES)
def test_every_head_dim_and_group(paged_batch, assert_close, hq, hkv, head_dim, dtype):
    """Decodes, prefill with fresh keys, a prefix hit, and a sliding window, per head dim."""
    batch = paged_batch(
        MIXED_Q, MIXED_SEQ, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    key, value = fresh_kv(batch)
    check(batch, assert_close, fresh_key=key, fresh_value=value, num_splits=2)
    check(batch, assert_close, sliding_window=24)


def test_fresh_key_and_value_in_their_own_layouts(paged_batch, assert_close):
    """Normed keys (Qwen3's q/k norm) are a tensor of their own while values stay a view into
    the fused QKV rows: each is read with its own strides."""
    batch = paged_batch(
        MIXED_Q, MIXED_SEQ, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=BF16,
    )  # fmt: skip
    key_view, value = fresh_kv(batch)
    key = key_view.contiguous()
    assert key.stride() != value.stride()
    check(batch, assert_close, fresh_key=key, fresh_value=value)
    check(batch, assert_close, fresh_key=key_view, fresh_value=value.contiguous())


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_logit_soft_cap(paged_batch, assert_close, dtype):
    """Gemma 2's soft-capped scores on decodes (split and whole), prefill from the pages and
    from the fresh keys, and under a window; queries scaled up so the cap bites."""
    batch = paged_batch(
        MIXED_Q, MIXED_SEQ, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    batch.q.mul_(6.0)
    key, value = fresh_kv(batch)
    for splits in (1, 3):
        check(batch, assert_close, soft_cap=5.0, num_splits=splits)
    check(batch, assert_close, soft_cap=5.0, fresh_key=key, fresh_value=value)
    check(batch, assert_close, soft_cap=5.0, sliding_window=24, num_splits=2)
    # The cap changes the result (the check above would see a kernel that ignored it).
    scale = {"scale": 64**-0.5}
    capped = pa.paged_attention_ref(*batch.args(), **scale, soft_cap=5.0)
    assert not torch.allclose(
        capped.float(), pa.paged_attention_ref(*batch.args(), **scale).float()
    )


def test_head_dims_past_the_tile_configs_are_not_supported():
    assert all(pa.supports_head_dim(d) for d in (8, 16, 32, 64, 80, 96, 112, 128, 192, 256))
    assert not pa.supports_head_dim(320) and not pa.supports_head_dim(512)
