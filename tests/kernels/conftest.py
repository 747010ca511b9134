"""Kernel tests: without CUDA, run the Triton kernels in Triton's CPU interpreter; paged-batch builders.

Triton chooses interpreter or compiler when it and each kernel are imported, so Triton and the
kernel modules are imported here with TRITON_INTERPRET=1, and the variable is then restored: the
rest of the suite keeps its own choice (a CPU run of other tests stays on the torch paths).
Kernel tests see TRITON_INTERPRET=1 while they run. They skip only where Triton is not installed:
with Triton here, a kernel that fails to import, build or run fails its tests.
"""

import importlib
import importlib.util
import os
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_MODULES = (
    "inferengine.kernels.pdl_kernels",
    "inferengine.kernels.attention_kernels",
    "inferengine.kernels.fused_kernels",
    "inferengine.kernels.fused_moe_kernels",
    "inferengine.kernels.lora_kernels",
)
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _patch_interpreter_bfloat16() -> None:
    """Triton's interpreter multiplies bfloat16 `tl.dot` operands as raw uint16 and truncates
    float32 -> bfloat16 casts; the GPU does neither. Make it compute as the GPU does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_inferengine_patched", False):
        return
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32, copy=True).view(np.uint32).astype(np.uint64)
            nearest_even = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return interpreter.TensorHandle(nearest_even.astype(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    builder.create_dot, builder.cast_impl = dot, cast
    builder._inferengine_patched = True


def _patch_interpreter_fp8() -> None:
    """Triton's interpreter drops the carry when rounding float32 up into the next fp8 binade
    (7.99 -> 4.0 in e4m3); the GPU rounds to nearest even. Cast to fp8 with torch instead."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_inferengine_fp8_patched", False):
        return
    fp_to_fp = builder.create_fp_to_fp
    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def cast(self, src, dst_type, rounding_mode):
        target = fp8.get(dst_type.scalar)
        if target is None or src.dtype.scalar not in (tl.float32, tl.float16, tl.bfloat16):
            return fp_to_fp(self, src, dst_type, rounding_mode)
        wide = self.cast_impl(src, tl.float32) if src.dtype.scalar != tl.float32 else src
        values = torch.from_numpy(np.ascontiguousarray(wide.data, dtype=np.float32))
        codes = values.to(target).view(torch.uint8).numpy()
        return interpreter.TensorHandle(codes, dst_type.scalar)

    builder.create_fp_to_fp = cast
    builder._inferengine_fp8_patched = True


def _import_interpreted() -> str | None:
    """Import Triton and the kernel modules in interpreter mode; why not, if Triton came
    compiled (a kernel module that fails to import raises)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl

        if type(tl.sum).__name__ != "InterpretedFunction":
            return (
                "triton was imported before tests/kernels/conftest.py could set "
                "TRITON_INTERPRET=1; run the kernel tests on their own or export TRITON_INTERPRET=1"
            )
        _patch_interpreter_bfloat16()
        _patch_interpreter_fp8()
        for name in KERNEL_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
        return None
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


SKIP_REASON = None if HAS_TRITON else "triton is not installed"
# Triton is here but the kernels cannot run in the interpreter: every kernel test fails.
FAIL_REASON = _import_interpreted() if HAS_TRITON and INTERPRET else None


@pytest.fixture(autouse=True)
def _interpret_while_testing(monkeypatch: pytest.MonkeyPatch) -> None:
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    if FAIL_REASON is not None:
        pytest.fail(FAIL_REASON)
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test's id: new data per test, the same data per rerun."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


# Attention-level tolerances: the kernels round probabilities to the input dtype before P @ V.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.fixture
def assert_close():
    """Compare in float32 at the tolerance of `expected`'s dtype; NaN anywhere fails."""

    def check(actual: torch.Tensor, expected: torch.Tensor, **tolerance: float) -> None:
        assert actual.dtype == expected.dtype
        tolerance = tolerance or TOLERANCES[expected.dtype]
        torch.testing.assert_close(actual.float(), expected.float(), **tolerance)

    return check


@dataclass
class PagedBatch:
    q: torch.Tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.kv_cache, self.query_start_loc, self.seq_lens, self.block_table


def make_paged_batch(
    gen: torch.Generator,
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    num_blocks: int | None = None,
    table_width: int | None = None,
) -> PagedBatch:
    """Random queries and pages for sequences with the given query and context lengths. Block
    ids are shuffled; the null block, spare blocks and page tails past each context are NaN, so
    a kernel that reads outside a context shows it."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = num_blocks or 1 + sum(blocks_per_seq) + 3
    table_width = table_width or max(blocks_per_seq, default=0) + 2
    ids = torch.randperm(num_blocks - 1, generator=gen)[: sum(blocks_per_seq)] + 1
    table = torch.zeros(len(q_lens), table_width, dtype=torch.int32)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype)
    taken = 0
    for i, (n_blocks, seq_len) in enumerate(zip(blocks_per_seq, seq_lens, strict=True)):
        table[i, :n_blocks] = ids[taken : taken + n_blocks]
        taken += n_blocks
        values = torch.randn(2, n_blocks * block_size, num_kv_heads, head_dim, generator=gen)
        values[:, seq_len:] = float("nan")
        pages = values.view(2, n_blocks, block_size, num_kv_heads, head_dim)
        kv_cache[:, table[i, :n_blocks].long()] = pages.to(dtype)
    starts = torch.tensor([0, *q_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device),
        kv_cache=kv_cache.to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )


@pytest.fixture
def paged_batch(gen: torch.Generator):
    """`make_paged_batch` with this test's generator."""

    def build(q_lens: list[int], seq_lens: list[int], **kwargs) -> PagedBatch:
        return make_paged_batch(gen, q_lens, seq_lens, **kwargs)

    return build
