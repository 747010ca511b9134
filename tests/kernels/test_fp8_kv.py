"""FP8 KV cache: the store kernels quantize as their torch references do, and paged attention
over fp8 pages (scales other than 1) matches the reference that dequantizes them."""

import dataclasses

import pytest
import torch

from inferengine.kernels import paged_attention as pa
from inferengine.kernels.kv_quant import dequantize, fp8_max, quantize
from inferengine.kernels.kv_store import (
    rotary_store_kv,
    rotary_store_kv_ref,
    store_kv,
    store_kv_ref,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, BF16 = torch.float32, torch.bfloat16
K_SCALE, V_SCALE = 0.37, 2.5


def assert_same_codes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal fp8 caches, but for a rounding step on a few elements (the kernel divides by the
    scale with its own division); NaN (never written) where the reference has NaN."""
    a, e = actual.float(), expected.float()
    assert torch.equal(a.isnan(), e.isnan())
    codes = (actual.view(torch.uint8).int() - expected.view(torch.uint8).int()).abs()
    assert int(codes.max()) <= 1
    assert codes.ne(0).float().mean() < 0.02


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (3, 96), (1, 8)])
def test_store_kv_quantizes_like_the_reference(
    gen, device, dtype, cache_dtype, num_kv_heads, head_dim
):
    num_tokens, num_blocks, block_size = 11, 6, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    slots[[2, 7]] = -1
    qkv = 4 * torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen)
    qkv[0, num_kv_heads, 0] = 1e5  # saturates, never inf or NaN
    qkv = qkv.to(device, dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), device=device).to(cache_dtype)
    expected = cache.clone()

    store_kv(key, value, cache, slots, K_SCALE, V_SCALE)
    store_kv_ref(key, value, expected, slots, K_SCALE, V_SCALE)

    assert_same_codes(cache, expected)
    assert cache.float().abs().nan_to_num(0.0).max() == fp8_max(cache_dtype)
    written = ~cache.float().isnan().view(2, -1, num_kv_heads * head_dim).all(-1)
    assert written.sum().item() == 2 * (num_tokens - 2)
    # Read back with the scales, the values are the inputs to fp8 precision (saturated aside).
    block, offset = int(slots[0]) // block_size, int(slots[0]) % block_size
    read = dequantize(cache[1, block, offset], V_SCALE, F32)
    torch.testing.assert_close(read, value[0].float(), rtol=0.13, atol=V_SCALE * 2**-6)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_rotary_store_kv_quantizes_the_rotated_key(gen, device, cache_dtype):
    from inferengine.kernels.rotary import compute_cos_sin_cache

    num_tokens, hq, hkv, head_dim, block_size = 6, 4, 2, 64, 16
    sizes = [hq * head_dim, hkv * head_dim, hkv * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes), generator=gen).to(device, BF16)
    qkv_ref = qkv.clone()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = compute_cos_sin_cache(inv_freq, 512).to(device)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(device)
    slots = torch.tensor([3, 17, -1, 40, 79, 0], device=device)
    shape = (2, 5, block_size, hkv, head_dim)
    cache = torch.full(shape, float("nan"), device=device).to(cache_dtype)
    cache_ref = cache.clone()

    def heads(t):
        q, k, v = t.split(sizes, dim=-1)
        return (q.view(num_tokens, hq, head_dim), k.view(num_tokens, hkv, head_dim),
                v.view(num_tokens, hkv, head_dim))  # fmt: skip

    rotary_store_kv(positions, *heads(qkv), cache, slots, cos_sin, K_SCALE, V_SCALE)
    rotary_store_kv_ref(positions, *heads(qkv_ref), cache_ref, slots, cos_sin, K_SCALE, V_SCALE)
    torch.testing.assert_close(qkv, qkv_ref)  # q and k rotated in place, not quantized
    assert_same_codes(cache, cache_ref)


def fp8_batch(paged_batch, q_lens, seq_lens, cache_dtype=E4M3, **kwargs):
    """`paged_batch` whose pages are quantized to `cache_dtype` with K_SCALE and V_SCALE (NaN
    pages and tails stay NaN)."""
    batch = paged_batch(q_lens, seq_lens, **kwargs)
    kv = batch.kv_cache
    cache = torch.empty(kv.shape, dtype=cache_dtype, device=kv.device)
    cache[0] = quantize(kv[0], K_SCALE, cache_dtype)
    cache[1] = quantize(kv[1], V_SCALE, cache_dtype)
    batch.kv_cache = cache
    return batch


def check(batch, assert_close, **kwargs) -> None:
    """The kernel on fp8 pages (into a NaN-poisoned output) against the reference."""
    head_dim = batch.q.shape[-1]
    window = kwargs.pop("sliding_window", None)
    cap = kwargs.pop("soft_cap", None)
    common = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    out = torch.full_like(batch.q, float("nan"))
    pa.paged_attention(
        *batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        out=out, **common, **scales, **kwargs,
    )  # fmt: skip
    expected = pa.paged_attention_ref(*batch.args(), **common, **scales)
    assert_close(out, expected)


SHAPES = [(2, 2, 64, 16, F32), (4, 2, 128, 32, BF16), (8, 1, 64, 16, BF16), (4, 1, 32, 16, F32)]
MIXED_Q = [1, 37, 1, 20, 16, 0, 1]
MIXED_SEQ = [45, 37, 130, 90, 48, 5, 2]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size", "dtype"), SHAPES)
def test_decode_over_fp8_pages(
    paged_batch, assert_close, hq, hkv, head_dim, block_size, dtype, num_splits
):
    batch = fp8_batch(
        paged_batch, [1] * 4, [1, 17, 64, 150], num_q_heads=hq, num_kv_heads=hkv,
        head_dim=head_dim, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    check(batch, assert_close, num_splits=num_splits)


@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size", "dtype"), SHAPES)
def test_mixed_batch_over_fp8_pages(
    paged_batch, assert_close, hq, hkv, head_dim, block_size, dtype
):
    """Decodes, prompts, prefix hits and chunks mid-block; fresh K/V given are not read (the
    chunk's keys come quantized from the pages, as a later prefix hit would see them)."""
    batch = fp8_batch(
        paged_batch, MIXED_Q, MIXED_SEQ, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    check(batch, assert_close, num_splits=2)
    garbage = torch.full((batch.q.shape[0], hkv, head_dim), 1e4, dtype=dtype, device=batch.q.device)
    check(batch, assert_close, fresh_key=garbage, fresh_value=garbage)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_window_soft_cap_and_e5m2_over_fp8_pages(paged_batch, assert_close, dtype):
    batch = fp8_batch(
        paged_batch, MIXED_Q, MIXED_SEQ, num_q_heads=4, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    check(batch, assert_close, sliding_window=24, num_splits=2)
    batch.q.mul_(6.0)
    for splits in (1, 3):
        check(batch, assert_close, soft_cap=5.0, num_splits=splits)
    e5m2 = fp8_batch(
        paged_batch, MIXED_Q, MIXED_SEQ, E5M2, num_q_heads=4, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    check(e5m2, assert_close, num_splits=2)


def test_fp8_attention_is_close_to_full_precision(paged_batch):
    """The scales act the right way round: attention over fp8 pages is the full-precision
    result to within fp8's rounding."""
    kwargs = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=F32)
    batch = paged_batch(MIXED_Q, MIXED_SEQ, **kwargs)
    full = pa.paged_attention_ref(*batch.args(), scale=0.125)
    kv = batch.kv_cache
    batch.kv_cache = torch.stack([quantize(kv[0], K_SCALE, E4M3), quantize(kv[1], V_SCALE, E4M3)])
    out = pa.paged_attention(
        *batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        scale=0.125, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    error = (out - full).abs()
    assert error.max() < 0.25 and error.mean() < 0.02
    unscaled = pa.paged_attention(
        *batch.args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        scale=0.125,
    )  # fmt: skip
    assert (unscaled - full).abs().mean() > 0.1


@pytest.mark.parametrize("fused_rotary", [False, True])
def test_triton_backend_matches_the_torch_backend_over_fp8(gen, device, fused_rotary):
    """The backends end to end (store, then attend) on one step over an fp8 cache: decodes,
    prompts and prefix hits, with the rotary embedding fused into the store or not."""
    from inferengine.attention.backends.base import AttentionSpec, RotaryInputs
    from inferengine.attention.backends.torch_ref import TorchAttentionBackend
    from inferengine.attention.backends.triton_backend import TritonAttentionBackend
    from inferengine.kernels.rotary import compute_cos_sin_cache, rotary_embedding_ref
    from tests.attention.test_flex_backend import paged_step

    q_lens, seq_lens = [1, 12, 1, 9], [40, 30, 8, 25]
    step = paged_step(
        gen, q_lens, seq_lens, heads=4, kv_heads=2, head_dim=64, block_size=16, shared_pages=1
    )
    q, k, v, cache = (t.to(device) for t in step[:4])
    md = dataclasses.replace(
        step[4],
        query_start_loc=step[4].query_start_loc.to(device),
        seq_lens=step[4].seq_lens.to(device),
        block_table=step[4].block_table.to(device),
        slot_mapping=step[4].slot_mapping.to(device),
    )
    cache = cache / 30  # paged_step's pages are 30x its K/V
    fp8 = torch.stack([quantize(cache[0], K_SCALE, E4M3), quantize(cache[1], V_SCALE, E4M3)])
    fp8_ref = fp8.clone()
    spec = AttentionSpec(4, 2, 64, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens, strict=True)])
    positions = positions.to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cos_sin = compute_cos_sin_cache(inv_freq, 512).to(device)

    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, cos_sin, 64)
    expected = TorchAttentionBackend().forward(spec, q_ref, k_ref, v, fp8_ref, md)
    if fused_rotary:
        rotary = RotaryInputs(positions, cos_sin)
        out = TritonAttentionBackend().forward(spec, q.clone(), k.clone(), v, fp8, md, rotary)
    else:
        out = TritonAttentionBackend().forward(spec, q_ref, k_ref.clone(), v, fp8, md)

    assert_same_codes(fp8, fp8_ref)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_engine_with_triton_over_fp8_matches_the_torch_backend(tiny_checkpoint, monkeypatch):
    """The engine's Triton path (fused rotary store, decode and prefill launches, padded
    shapes) on an fp8 cache chooses the next tokens the torch reference backend chooses."""
    from inferengine import LLM, SamplingParams
    from inferengine.attention import selector
    from tests.engine.test_fp8_kv_cache import agreement, argmax_per_position, prompts, requests

    monkeypatch.setattr(selector, "_triton_usable", lambda device: True)
    path = str(tiny_checkpoint("qwen3"))
    token_lists = prompts(8, lengths=(40, 70, 9))
    common = dict(max_model_len=256, kv_cache_dtype="fp8", max_num_batched_tokens=64)
    triton = LLM(path, attention_backend="triton", **common)
    triton.llm_engine.core.executor.worker.runner.capture_cuda_graphs(
        [1, 2, 4], [64], capture=False
    )
    reference = LLM(path, attention_backend="torch", **common)
    chosen = argmax_per_position(triton, token_lists)
    assert agreement(chosen, argmax_per_position(reference, token_lists)) >= 0.98
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def greedy(llm: LLM) -> list[list[int]]:
        outs = llm.generate(requests(token_lists), params, use_tqdm=False)
        return [out.outputs[0].token_ids for out in outs]

    assert agreement(greedy(triton), greedy(reference)) >= 2 / 3
