"""Batched LoRA shrink/expand (kernels/lora.py) against the per-token definition."""

from __future__ import annotations

import pytest
import torch

from inferengine.kernels.lora import lora_expand_ref, lora_ref_loop, lora_shrink_ref


def _case(tokens=37, slots=3, rank=8, in_f=48, out_f=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_f, generator=g)
    a = torch.randn(slots, rank, in_f, generator=g)
    b = torch.randn(slots, out_f, rank, generator=g)
    # Slot 1 holds a rank-3 adapter in rank-8 slots: its padding rows/columns are zero.
    a[1, 3:], b[1, :, 3:] = 0, 0
    token_slots = torch.randint(-1, slots, (tokens,), generator=g)
    scales = torch.tensor([0.5, 2.0, 1.25])
    return x, a, b, token_slots, scales


def test_shrink_then_expand_is_the_per_token_product():
    x, a, b, token_slots, scales = _case()
    y = torch.randn(x.shape[0], b.shape[1])
    base = y.clone()
    out = lora_expand_ref(y, lora_shrink_ref(x, a, token_slots), b, token_slots, scales)
    assert out is y
    torch.testing.assert_close(y - base, lora_ref_loop(x, a, b, token_slots, scales))
    untouched = token_slots < 0
    assert untouched.any() and torch.equal(y[untouched], base[untouched])


def test_expand_writes_only_its_slice_of_a_fused_output():
    x, a, b, token_slots, scales = _case(seed=1)
    fused = torch.zeros(x.shape[0], 100)
    lora_expand_ref(fused, lora_shrink_ref(x, a, token_slots), b, token_slots, scales, offset=30)
    torch.testing.assert_close(fused[:, 30:70], lora_ref_loop(x, a, b, token_slots, scales))
    assert not fused[:, :30].any() and not fused[:, 70:].any()


def test_a_step_without_adapters_adds_nothing_and_one_slot_serves_all():
    x, a, b, _, scales = _case(seed=2)
    none = torch.full((x.shape[0],), -1)
    assert not lora_shrink_ref(x, a, none).any()
    every = torch.full((x.shape[0],), 2)
    y = lora_expand_ref(torch.zeros(x.shape[0], b.shape[1]), lora_shrink_ref(x, a, every), b,
                        every, scales)  # fmt: skip
    torch.testing.assert_close(y, scales[2] * (x @ a[2].t() @ b[2].t()))


def test_the_triton_pair_matches_the_reference(device):
    """Interpreted on the CPU (TRITON_INTERPRET=1, tests/kernels/conftest.py) or on a GPU:
    ragged token, rank and feature counts; a rank-3 adapter in rank-8 slots; −1 tokens."""
    pytest.importorskip("triton")
    from inferengine.kernels.lora import lora_expand, lora_shrink

    x, a, b, token_slots, scales = (t.to(device) for t in _case(tokens=13, in_f=70, out_f=45))
    shrunk = lora_shrink(x, a, token_slots, block_r=4, block_k=32)
    torch.testing.assert_close(shrunk, lora_shrink_ref(x, a, token_slots))
    fused = torch.randn(x.shape[0], 100, device=device)
    want = lora_expand_ref(fused.clone(), shrunk, b, token_slots, scales, offset=30)
    got = lora_expand(fused, shrunk, b, token_slots, scales, offset=30, block_n=16, block_r=4)
    torch.testing.assert_close(got, want)
