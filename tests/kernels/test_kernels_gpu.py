"""Kernels at real model sizes on a GPU (Qwen2.5-7B heads: 28 query, 4 KV, head dim 128), and
paged attention inside a CUDA graph."""

import pytest
import torch

from inferengine.kernels import activation, kv_store, norm, paged_attention, rotary
from tests.kernels.test_paged_attention import padded_fresh_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
QWEN = {"num_q_heads": 28, "num_kv_heads": 4, "head_dim": 128}
BF16 = torch.bfloat16


def attend(batch, *, max_query_len=None, max_seq_len=None, sliding_window=None, soft_cap=None):
    out = torch.full_like(batch.q, float("nan"))
    paged_attention.paged_attention(
        *batch.args(),
        max_query_len=max_query_len or batch.max_query_len,
        max_seq_len=max_seq_len or batch.max_seq_len,
        scale=batch.q.shape[-1] ** -0.5,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        out=out,
    )
    return out


def reference(batch, sliding_window=None, soft_cap=None):
    scale = batch.q.shape[-1] ** -0.5
    return paged_attention.paged_attention_ref(
        *batch.args(), scale=scale, sliding_window=sliding_window, soft_cap=soft_cap
    )


def random_lens(gen: torch.Generator, n: int, low: int, high: int) -> list[int]:
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_batch(gen, paged_batch, assert_close, block_size):
    seq_lens = [1, 8192, *random_lens(gen, 30, 2, 8192)]
    batch = paged_batch([1] * 32, seq_lens, block_size=block_size, dtype=BF16, **QWEN)
    assert_close(attend(batch), reference(batch))
    # Batch 1 at a long context: many splits.
    single = paged_batch([1], [8000], block_size=block_size, dtype=BF16, **QWEN)
    assert_close(attend(single, max_seq_len=32768), reference(single))


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_batch(paged_batch, assert_close, block_size):
    lens = [1, 300, 2048]
    batch = paged_batch(lens, lens, block_size=block_size, dtype=BF16, **QWEN)
    assert_close(attend(batch), reference(batch))


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch(gen, paged_batch, assert_close, block_size):
    """Decodes, a 512-token chunk continuing a 4k prefix, a prefix hit, a new prompt."""
    q_lens = [1] * 24 + [512, 100, 777]
    seq_lens = [*random_lens(gen, 24, 1, 8192), 4608, 3000, 777]
    batch = paged_batch(q_lens, seq_lens, block_size=block_size, dtype=BF16, **QWEN)
    expected = reference(batch)
    assert_close(attend(batch), expected)
    assert_close(attend(batch, max_query_len=2048, max_seq_len=32768), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes(paged_batch, assert_close, dtype):
    batch = paged_batch([1, 1, 300], [5000, 17, 1200], block_size=16, dtype=dtype, **QWEN)
    assert_close(attend(batch), reference(batch))


def test_sliding_window(paged_batch, assert_close):
    """Mistral-7B shape: 32 query heads, 8 KV heads, window 4096."""
    shape = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    batch = paged_batch(
        [1, 1, 600, 1000], [7000, 300, 6000, 1000], block_size=16, dtype=BF16, **shape
    )
    assert_close(attend(batch, sliding_window=4096), reference(batch, sliding_window=4096))


@pytest.mark.parametrize("window", [None, 4096])
def test_soft_cap_at_gemma2_size(paged_batch, assert_close, window):
    """Gemma-2-2B shape: 8 query heads, 4 KV heads, head dim 256, scores capped at 50 (queries
    scaled up so the cap bites), with and without its 4096 window."""
    shape = {"num_q_heads": 8, "num_kv_heads": 4, "head_dim": 256}
    batch = paged_batch(
        [1, 1, 600, 1000], [7000, 300, 6000, 1000], block_size=16, dtype=BF16, **shape
    )
    batch.q.mul_(20.0)
    capped = dict(sliding_window=window, soft_cap=50.0)
    assert_close(attend(batch, **capped), reference(batch, **capped))


@pytest.mark.parametrize("max_query_len", [1, 512])
def test_cuda_graph_replay(gen, paged_batch, assert_close, max_query_len):
    """Capture once with bounds, replay on new contents and lengths in the same buffers."""
    q_lens = [1] * 7 + [max_query_len]
    shape = {"block_size": 16, "dtype": BF16, "num_blocks": 1200, "table_width": 130, **QWEN}
    static = paged_batch(q_lens, [100] * 7 + [600], **shape)
    out = torch.empty_like(static.q)

    def step():
        paged_attention.paged_attention(
            *static.args(), max_query_len=max_query_len, max_seq_len=8192, scale=0.1, out=out
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for _ in range(2):
        new_lens = [*random_lens(gen, 7, 1, 2000), max_query_len + 1500]
        fresh = paged_batch(q_lens, new_lens, **shape)
        for buffer, value in zip(static.args(), fresh.args(), strict=True):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, paged_attention.paged_attention_ref(*fresh.args(), scale=0.1))


@pytest.mark.parametrize("fresh_tma", [True, False])
def test_prefix_hit_chunks_beside_nan_graph_padding(gen, paged_batch, assert_close, fresh_tma):
    """Prefix-hit chunks of a few tokens with decodes in a mixed CUDA-graph step padded to 64
    tokens, the padding's fresh K/V rows NaN (as unwritten attention rows can leave them): the
    chunks' last key tiles read those rows (TMA) and must still come out right. With NaN there,
    every new request that hit the prefix cache sampled token 0 (the JSON failures)."""
    q_lens = [1] * 6 + [3, 10]
    seq_lens = [*random_lens(gen, 6, 50, 600), 291, 346]
    batch = paged_batch(q_lens, seq_lens, block_size=16, dtype=BF16, **QWEN)
    q, key, value = padded_fresh_kv(batch, 64 - sum(q_lens))
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_attention(
        q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        max_query_len=64, max_seq_len=8192, scale=0.1, out=out, fresh_key=key,
        fresh_value=value, fresh_tma=fresh_tma,
    )  # fmt: skip
    expected = paged_attention.paged_attention_ref(*batch.args(), scale=0.1)
    assert_close(out[: sum(q_lens)], expected)


def test_fused_ops_at_model_size(gen, device, assert_close):
    tokens, hidden, inter = 1000, 3584, 18944
    x = torch.randn(tokens, hidden, generator=gen).to(dtype=BF16, device=device)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype=BF16, device=device)
    weight = torch.randn(hidden, generator=gen).to(dtype=BF16, device=device)
    ulp = {"atol": 1.6e-2, "rtol": 1.6e-2}
    assert_close(norm.rms_norm(x, weight, 1e-6), norm.rms_norm_ref(x, weight, 1e-6), **ulp)
    x_ref, r_ref = norm.fused_add_rms_norm_ref(x.clone(), residual.clone(), weight, 1e-6)
    norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_close(residual, r_ref, atol=0, rtol=0)
    assert_close(x, x_ref, **ulp)

    gate_up = torch.randn(tokens, 2 * inter, generator=gen).to(dtype=BF16, device=device)
    assert_close(activation.silu_and_mul(gate_up), activation.silu_and_mul_ref(gate_up), **ulp)

    q_size, kv_size = 28 * 128, 4 * 128
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype=BF16, device=device)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32, device=device) / 128)
    cos_sin = rotary.compute_cos_sin_cache(inv_freq, 32768)
    positions = torch.randint(0, 32768, (tokens,), generator=gen).to(device)
    expected = qkv.clone()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    rotary.rotary_embedding(positions, q, k, cos_sin, 128)
    q_ref, k_ref, _ = expected.split([q_size, kv_size, kv_size], dim=-1)
    rotary.rotary_embedding_ref(positions, q_ref, k_ref, cos_sin, 128)
    assert_close(qkv, expected, **ulp)

    cache = torch.full((2, 200, 16, 4, 128), float("nan"), dtype=BF16, device=device)
    cache_ref = cache.clone()
    slots = torch.randperm(200 * 16, generator=gen)[:tokens].to(device)
    slots[::7] = -1
    key, value = k.view(tokens, 4, 128), v.view(tokens, 4, 128)
    kv_store.store_kv(key, value, cache, slots)
    kv_store.store_kv_ref(key, value, cache_ref, slots)
    torch.testing.assert_close(cache, cache_ref, equal_nan=True, rtol=0, atol=0)
