"""An integer checkpoint loads without a full-precision weight: the packed tensors are created
at construction and filled from the shards, and the repack into the kernels' layout works a
block of columns at a time (what lets a 70B int4 checkpoint load near its packed size)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from inferengine.kernels import int4_gemm
from tests.model.paged_runner import load_tiny
from tests.model.quantization.int_checkpoints import Scheme, write_int_pair


class TensorSizes(TorchDispatchMode):
    """The shape and dtype of every tensor any torch op makes while it is on."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append((tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize(
    "scheme", [Scheme("awq", 4, 32), Scheme("compressed-tensors", 4, 32)], ids=["awq", "ct"]
)
def test_int_load_makes_no_float_weight(float_source, tmp_path, monkeypatch, scheme):
    q_dir, float_dir = write_int_pair(float_source("qwen2"), tmp_path, scheme, scheme.method)
    floats = load_file(float_dir / "model.safetensors")
    weight_shapes = set()
    for name, w in floats.items():
        if name.endswith("_proj.weight"):
            weight_shapes |= {tuple(w.shape), tuple(w.t().shape)}
    layer = "model.layers.0."
    for parts in (("q", "k", "v"), ("gate", "up")):  # fused layers
        module = "self_attn" if parts[0] == "q" else "mlp"
        ws = [floats[f"{layer}{module}.{p}_proj.weight"] for p in parts]
        rows = sum(w.shape[0] for w in ws)
        weight_shapes |= {(rows, ws[0].shape[1]), (ws[0].shape[1], rows)}
    # Repack in blocks of 2048 values: the unpacked block (and its int32 words) stay small.
    monkeypatch.setattr(int4_gemm, "_REF_ELEMENTS", 2048)
    with TensorSizes() as seen:
        model, _ = load_tiny(q_dir)
    float_weights = [s for s, d in seen.made if d.is_floating_point and s in weight_shapes]
    assert not float_weights, f"full-precision weights made while loading: {float_weights[:3]}"
    # Integer tensors: none larger than the largest packed parameter (a fused layer's).
    largest = max(p.numel() * p.element_size() for p in model.parameters()
                  if not p.is_floating_point())  # fmt: skip
    ints = [torch.Size(s).numel() * d.itemsize for s, d in seen.made
            if not d.is_floating_point and len(s) == 2]  # fmt: skip
    assert ints and max(ints) <= largest, (max(ints), largest)
