"""The tensor-parallel group of this process: rank, size and the collectives layers need."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1


_tp = TensorParallelGroup()


def init_tensor_parallel(rank: int, size: int, group: object | None = None) -> None:
    """Called once per worker process by a multi-GPU executor before the model is built."""
    global _tp
    _tp = TensorParallelGroup(rank, size, group)


def get_tp_rank() -> int:
    return _tp.rank


def get_tp_size() -> int:
    return _tp.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp.size == 1:
        return x
    torch.distributed.all_reduce(x, group=_tp.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_tp.group)
    return torch.cat(parts, dim=dim)
