"""Logit soft-capping (Gemma 2) in every CPU backend: the torch reference against the kernels'
independent reference function, and FlexAttention against the torch reference."""

import zlib

import pytest
import torch

from inferengine.attention.backends.base import AttentionSpec
from inferengine.attention.backends.flex import FlexAttentionBackend, flex_available
from inferengine.attention.backends.torch_ref import TorchAttentionBackend
from inferengine.kernels.paged_attention import paged_attention_ref
from tests.attention.test_flex_backend import CASES, paged_step

CAP = 3.0


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _step(gen, case: str):
    q_lens, seq_lens = CASES[case]
    q, k, v, kv_cache, md = paged_step(
        gen, q_lens, seq_lens, heads=8, kv_heads=2, head_dim=16, block_size=4, shared_pages=1
    )
    return q * 4, k, v, kv_cache, md  # large scores, so the cap bites


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_torch_reference_caps_scores(gen, case, sliding_window):
    q, k, v, kv_cache, md = _step(gen, case)
    spec = AttentionSpec(8, 2, 16, 0.25, sliding_window, logits_soft_cap=CAP)
    out = TorchAttentionBackend().forward(spec, q, k, v, kv_cache, md)
    args = (q, kv_cache, md.query_start_loc, md.seq_lens, md.block_table)
    window = {"scale": 0.25, "sliding_window": sliding_window}
    expected = paged_attention_ref(*args, **window, soft_cap=CAP)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    uncapped = paged_attention_ref(*args, **window)
    assert not torch.allclose(out, uncapped, atol=1e-3)


@pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")
@pytest.mark.parametrize("case", CASES)
def test_flex_caps_scores_like_the_torch_reference(gen, case):
    q, k, v, kv_cache, md = _step(gen, case)
    spec = AttentionSpec(8, 2, 16, 0.25, 6, logits_soft_cap=CAP)
    expected = TorchAttentionBackend().forward(spec, q, k, v, kv_cache.clone(), md)
    actual = FlexAttentionBackend().forward(spec, q, k, v, kv_cache, md)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
