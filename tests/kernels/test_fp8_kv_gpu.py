"""FP8 KV cache kernels at real model sizes on a GPU (Qwen2.5-7B heads: 28 query, 4 KV, head dim
128; Mistral's window; Gemma 2's cap), and fp8 paged attention inside a CUDA graph."""

import pytest
import torch

from inferengine.kernels import kv_store, paged_attention
from tests.kernels.test_fp8_kv import E4M3, K_SCALE, V_SCALE, assert_same_codes, fp8_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
QWEN = {"num_q_heads": 28, "num_kv_heads": 4, "head_dim": 128}
BF16 = torch.bfloat16
SCALES = {"k_scale": K_SCALE, "v_scale": V_SCALE}


def attend(batch, *, max_query_len=None, max_seq_len=None, **kwargs):
    out = torch.full_like(batch.q, float("nan"))
    paged_attention.paged_attention(
        *batch.args(),
        max_query_len=max_query_len or batch.max_query_len,
        max_seq_len=max_seq_len or batch.max_seq_len,
        scale=batch.q.shape[-1] ** -0.5,
        out=out,
        **SCALES,
        **kwargs,
    )
    return out


def reference(batch, **kwargs):
    scale = batch.q.shape[-1] ** -0.5
    return paged_attention.paged_attention_ref(*batch.args(), scale=scale, **SCALES, **kwargs)


def random_lens(gen: torch.Generator, n: int, low: int, high: int) -> list[int]:
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_prefill_and_mixed_batches(gen, paged_batch, assert_close, block_size):
    decode = [1, 8192, *random_lens(gen, 30, 2, 8192)]
    batch = fp8_batch(paged_batch, [1] * 32, decode, block_size=block_size, dtype=BF16, **QWEN)
    assert_close(attend(batch), reference(batch))
    lens = [1, 300, 2048]
    batch = fp8_batch(paged_batch, lens, lens, block_size=block_size, dtype=BF16, **QWEN)
    assert_close(attend(batch), reference(batch))
    q_lens = [1] * 24 + [512, 100, 777]
    seq_lens = [*random_lens(gen, 24, 1, 8192), 4608, 3000, 777]
    batch = fp8_batch(paged_batch, q_lens, seq_lens, block_size=block_size, dtype=BF16, **QWEN)
    assert_close(attend(batch, max_query_len=2048, max_seq_len=32768), reference(batch))


def test_window_and_soft_cap(paged_batch, assert_close):
    mistral = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    q_lens, seq_lens = [1, 1, 600, 1000], [7000, 300, 6000, 1000]
    batch = fp8_batch(paged_batch, q_lens, seq_lens, block_size=16, dtype=BF16, **mistral)
    window = {"sliding_window": 4096}
    assert_close(attend(batch, **window), reference(batch, **window))
    gemma2 = {"num_q_heads": 8, "num_kv_heads": 4, "head_dim": 256}
    batch = fp8_batch(paged_batch, q_lens, seq_lens, block_size=16, dtype=BF16, **gemma2)
    batch.q.mul_(20.0)
    capped = {"sliding_window": 4096, "soft_cap": 50.0}
    assert_close(attend(batch, **capped), reference(batch, **capped))


def test_store_at_model_size(gen, device):
    tokens = 1000
    kv = (4 * torch.randn(tokens, 8, 128, generator=gen)).to(device, BF16)
    key, value = kv[:, :4], kv[:, 4:]
    cache = torch.full((2, 200, 16, 4, 128), float("nan"), device=device).to(E4M3)
    cache_ref = cache.clone()
    slots = torch.randperm(200 * 16, generator=gen)[:tokens].to(device)
    slots[::7] = -1
    kv_store.store_kv(key, value, cache, slots, K_SCALE, V_SCALE)
    kv_store.store_kv_ref(key, value, cache_ref, slots, K_SCALE, V_SCALE)
    assert_same_codes(cache, cache_ref)


def test_cuda_graph_replay_over_fp8(gen, paged_batch, assert_close):
    """Capture once with bounds (the scales are captured as launch arguments), replay on new
    pages and lengths in the same buffers."""
    q_lens = [1] * 7 + [512]
    shape = {"block_size": 16, "dtype": BF16, "num_blocks": 1200, "table_width": 130, **QWEN}
    static = fp8_batch(paged_batch, q_lens, [100] * 7 + [600], **shape)
    out = torch.empty_like(static.q)

    def step():
        paged_attention.paged_attention(
            *static.args(), max_query_len=512, max_seq_len=8192, scale=0.1, out=out, **SCALES
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        fresh = fp8_batch(paged_batch, q_lens, [*random_lens(gen, 7, 1, 2000), 2012], **shape)
        for buffer, value in zip(static.args(), fresh.args(), strict=True):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        expected = paged_attention.paged_attention_ref(*fresh.args(), scale=0.1, **SCALES)
        assert_close(out, expected)
