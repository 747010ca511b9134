"""This process's place among the ranks: its tensor- and pipeline-parallel groups and the
collectives that model layers and the model runner need.

Ranks are numbered `pp_rank * tp_size + tp_rank`: the ranks of one pipeline stage form a
tensor-parallel group, the ranks with the same `tp_rank` across stages a pipeline group. With one
rank (no executor set anything up) every collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from inferengine.logger import init_logger

if TYPE_CHECKING:
    from inferengine.distributed.custom_all_reduce import CustomAllReduce

logger = init_logger(__name__)


@dataclass
class ParallelGroup:
    rank: int = 0  # this process's index in the group
    size: int = 1
    ranks: tuple[int, ...] = (0,)  # global ranks, in group order
    group: object | None = None  # device collectives: NCCL on GPU, gloo on CPU
    cpu_group: object | None = None  # gloo, for small host-side messages
    custom: CustomAllReduce | None = None  # small-message all-reduce (GPU only)


_tp = ParallelGroup()
_pp = ParallelGroup()
_world_cpu: object | None = None  # gloo over every rank, for small host-side messages


def init_distributed(
    rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device
) -> None:
    """Join the world of `tp_size * pp_size` ranks and build the groups (once per worker
    process, before the model is built). Every rank creates every group, in the same order."""
    global _tp, _pp, _world_cpu
    backend = "nccl" if device.type == "cuda" else "gloo"
    world = tp_size * pp_size
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank, **kwargs)
    pp_rank, tp_rank = divmod(rank, tp_size)
    stages = [[s * tp_size + t for t in range(tp_size)] for s in range(pp_size)]
    _tp = _join_groups(stages, pp_rank, tp_rank, backend)
    columns = [[s * tp_size + t for s in range(pp_size)] for t in range(tp_size)]
    _pp = _join_groups(columns, tp_rank, pp_rank, backend)
    _world_cpu = dist.new_group(list(range(world)), backend="gloo") if backend != "gloo" else None
    if device.type == "cuda" and tp_size > 1:
        from inferengine.distributed.custom_all_reduce import CustomAllReduce

        _tp.custom = CustomAllReduce.create(_tp.group, device)


def _join_groups(
    all_ranks: list[list[int]], mine: int, my_index: int, backend: str
) -> ParallelGroup:
    """Create a group for each list of `all_ranks` (every process creates every group, in the
    same order) and return the `mine`-th, where this process has index `my_index`."""
    result = ParallelGroup()
    for i, ranks in enumerate(all_ranks):
        group = dist.new_group(ranks, backend=backend)
        cpu = dist.new_group(ranks, backend="gloo") if backend != "gloo" else group
        if i == mine:
            result = ParallelGroup(my_index, len(ranks), tuple(ranks), group, cpu)
    return result


def destroy_distributed() -> None:
    global _tp, _pp, _world_cpu
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp, _pp, _world_cpu = ParallelGroup(), ParallelGroup(), None


def gather_objects(obj: object) -> list[object]:
    """`obj` of every rank, in rank order (a collective over the host; [obj] with one rank)."""
    if not dist.is_initialized():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_world_cpu)
    return out


def all_reduce_name() -> str:
    """The all-reduce tensor-parallel layers use, for the start-up log."""
    if _tp.size == 1:
        return "none (one rank)"
    if _tp.custom is not None:
        return _tp.custom.name
    return _backend_name()


def _backend_name() -> str:
    return "NCCL" if dist.get_backend(_tp.group) == "nccl" else "gloo"


def all_reduce_by_size(sizes: list[int], dtype: torch.dtype) -> list[str]:
    """The all-reduce a tensor-parallel message of each size (bytes, of `dtype`) takes."""
    if _tp.size == 1:
        return ["none"] * len(sizes)
    custom = _tp.custom
    return [
        "one-shot" if custom is not None and custom.covers(n, dtype) else _backend_name()
        for n in sizes
    ]


# ---- tensor parallel -----------------------------------------------------------------------


def get_tp_rank() -> int:
    return _tp.rank


def get_tp_size() -> int:
    return _tp.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp.size == 1:
        return x
    if _tp.custom is not None and _tp.custom.should_use(x):
        return _tp.custom.all_reduce(x)
    dist.all_reduce(x, group=_tp.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_tp.group)
    return torch.cat(parts, dim=dim)


# ---- pipeline parallel ---------------------------------------------------------------------


def get_pp_size() -> int:
    return _pp.size


def is_first_stage() -> bool:
    return _pp.rank == 0


def is_last_stage() -> bool:
    return _pp.rank == _pp.size - 1


def pp_layer_range(num_layers: int, stage: int | None = None) -> tuple[int, int]:
    """The decoder layers [start, end) that pipeline stage `stage` (default: this one) runs;
    the first `num_layers % pp_size` stages take one layer more."""
    size = _pp.size
    stage = _pp.rank if stage is None else stage
    base, extra = divmod(num_layers, size)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Hand activations to the next stage's rank with the same tensor-parallel rank."""
    peer = _pp.ranks[_pp.rank + 1]
    for t in tensors:
        dist.send(t.contiguous(), dst=peer)


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device):
    """Activations from the previous stage, one tensor per shape."""
    peer = _pp.ranks[_pp.rank - 1]
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=peer)
        out.append(t)
    return out
