"""CustomAllReduce: None without a place to run (no crash), and on two GPUs the same sums as
NCCL's all_reduce, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import logging
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inferengine.distributed.custom_all_reduce import CustomAllReduce
from tests.conftest import logged_messages

LOGGER = "inferengine.distributed.custom_all_reduce"
# The GPU hosts keep NVLink multicast off in NCCL, torch and NVSHMEM.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@pytest.fixture
def reasons():
    """The messages CustomAllReduce logs (the package logger does not propagate to caplog)."""
    with logged_messages(logging.NOTSET, LOGGER) as messages:
        yield messages


@pytest.fixture
def one_rank_world(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_none_without_torch_distributed(reasons):
    assert not dist.is_initialized()
    assert CustomAllReduce.create(None, torch.device("cpu")) is None
    assert any("not initialised" in m for m in reasons)


def test_none_for_one_rank(one_rank_world, reasons):
    # Refused before the device is touched: a CUDA device on a machine without one is fine.
    assert CustomAllReduce.create(one_rank_world, torch.device("cuda", 0)) is None
    assert CustomAllReduce.create(one_rank_world, torch.device("cpu")) is None
    assert any("one rank" in m for m in reasons)


# ---- two GPUs ------------------------------------------------------------------------------

# (64, 8192) in float32 is exactly DEFAULT_MAX_BYTES, the largest message the one-shot path takes.
SHAPES = [(1, 8192), (16, 8192), (3, 4096), (64, 8192), (2048,), (1, 2)]
DTYPES = [torch.bfloat16, torch.float32]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = 1e-2 if got.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _reference(x: torch.Tensor) -> torch.Tensor:
    want = x.clone()
    dist.all_reduce(want)
    return want


def _eager(custom: CustomAllReduce, rank: int, device: torch.device) -> None:
    for shape in SHAPES:
        for dtype in DTYPES:
            x = torch.randn(shape, dtype=dtype, device=device) * (rank + 1)
            assert custom.should_use(x), (shape, dtype)
            before = x.clone()
            got = custom.all_reduce(x)
            torch.testing.assert_close(x, before, rtol=0, atol=0)  # x is left as it was
            _check(got, _reference(x), f"eager {shape} {dtype}")
    # An input 2 bytes past a 16-byte boundary takes the unfused copy.
    base = torch.randn(8193, dtype=torch.bfloat16, device=device)
    x = base[1:]
    _check(custom.all_reduce(x), _reference(x), "offset input")
    assert not custom.should_use(torch.randn(8, dtype=torch.float16, device=device))
    assert not custom.should_use(torch.randn(3, dtype=torch.bfloat16, device=device))
    too_big = torch.empty(custom.max_bytes // 2 + 1, dtype=torch.bfloat16, device=device)
    assert not custom.should_use(too_big)


def _graphs(custom: CustomAllReduce, device: torch.device) -> None:
    for shape in [(1, 8192), (16, 8192), (3, 4096)]:
        for dtype in DTYPES:
            static_in = torch.zeros(shape, dtype=dtype, device=device)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                custom.all_reduce(static_in)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = custom.all_reduce(static_in)
                static_out = custom.all_reduce(static_out * 0.5)  # two in a row
            for _ in range(3):
                fresh = torch.randn(shape, dtype=dtype, device=device)
                static_in.copy_(fresh)
                graph.replay()
                want = _reference(_reference(fresh).mul_(0.5))
                _check(static_out, want, f"graph {shape} {dtype}")


def _worker(rank: int, world: int, port: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device
    )
    try:
        custom = CustomAllReduce.create(dist.group.WORLD, device)
        assert custom is not None, "CustomAllReduce.create returned None on CUDA"
        torch.manual_seed(1234 + rank)
        _eager(custom, rank, device)
        _graphs(custom, device)
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_matches_nccl_on_two_gpus(monkeypatch):
    for name, value in MULTICAST_OFF.items():
        monkeypatch.setenv(name, value)
    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)
