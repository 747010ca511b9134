"""One-shot all-reduce for the small messages of tensor-parallel decode, on torch's symmetric
memory: each rank copies its tensor into a buffer every peer has mapped (CUDA IPC over NVLink),
then every rank reads and sums all of them in one kernel. NCCL stays the path for large messages.

Never NVLink multicast (`multimem` instructions): the rendezvous is made with torch's multicast
object switched off, and only the `one_shot_all_reduce*` ops, which read peers' buffers with
ordinary loads, are called.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from inferengine import envs
from inferengine.logger import init_logger

logger = init_logger(__name__)

# On two H200s the one-shot path wins up to 2 MiB and NCCL's ring from 4 MiB on, in graphs and
# eager alike (benchmarks/results/20261124T223759Z-all-reduce-latency;
# the same at ad8713a, in git history).
DEFAULT_MAX_BYTES = 2 << 20
# torch's one-shot kernel is instantiated for these only (AT_DISPATCH_FLOAT_AND_BFLOAT16).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
_SMOKE_NUMEL = 4096


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


class CustomAllReduce:
    """One-shot all-reduce for small messages over symmetric memory (CUDA IPC peer buffers)."""

    def __init__(
        self, group_name: str, buffer: torch.Tensor, handle: object, max_bytes: int
    ) -> None:
        self.group_name = group_name
        self.device = buffer.device
        self.max_bytes = max_bytes
        self.name = f"one-shot symmetric memory (<= {_mib(max_bytes)}), NCCL above"
        self._buffer, self._handle = buffer, handle  # the peers' mappings live as long as these
        self._typed = {dtype: buffer.view(dtype) for dtype in SUPPORTED_DTYPES}
        self._fused_copy = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy")

    @classmethod
    def create(
        cls, group: object | None, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> CustomAllReduce | None:
        """The all-reduce for `group` on `device`, or None (the reason logged) where it cannot
        run. A collective: every rank of the group calls it, and all get an object or all None."""
        if not dist.is_available() or not dist.is_initialized():
            logger.info("custom all-reduce not used: torch.distributed is not initialised")
            return None
        group = group if group is not None else dist.group.WORLD
        if dist.get_world_size(group) < 2:
            logger.info("custom all-reduce not used: the group has one rank")
            return None
        if device.type != "cuda" or "nccl" not in str(dist.get_backend(group)):
            logger.info("custom all-reduce not used: it needs CUDA devices and an NCCL group")
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(device):
            return cls._create_on(group, device, max_bytes)

    @classmethod
    def _create_on(
        cls, group: object, device: torch.device, max_bytes: int
    ) -> CustomAllReduce | None:
        # Every step ends with a vote, so that no rank goes on alone into a collective (the
        # rendezvous, the first all-reduce) that another rank has given up before.
        reason = _peer_access_problem(group, device)
        reason = _missing_api() or reason
        if not _all_ranks_agree(group, device, reason):
            return None
        buffer, reason = _attempt("allocating the buffer", _allocate, device, max_bytes)
        if not _all_ranks_agree(group, device, reason):
            return None
        handle, reason = _attempt("the rendezvous", _rendezvous, buffer, group)
        if not _all_ranks_agree(group, device, reason):
            return None
        custom = cls(group.group_name, buffer, handle, max_bytes)
        wrong, reason = _attempt("the first all-reduce", custom._smoke_test, group)
        if not _all_ranks_agree(group, device, reason or wrong):
            return None
        logger.info("tensor-parallel all-reduce: %s", custom.name)
        return custom

    def _smoke_test(self, group: object) -> str | None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        x = torch.full((_SMOKE_NUMEL,), rank + 1, dtype=torch.bfloat16, device=self.device)
        y = self.all_reduce(x)
        expected = world * (world + 1) // 2
        if not bool((y == expected).all()):
            return f"the first all-reduce summed to {y[0].item()}, not {expected}"
        return None

    def should_use(self, x: torch.Tensor) -> bool:
        return (
            x.is_cuda
            and self.covers(x.nbytes, x.dtype)
            and x.is_contiguous()
            and x.device == self.device
        )

    def covers(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether a contiguous message of `nbytes` of `dtype` on this device takes this path."""
        # the kernel's smallest vector is 4 bytes
        return dtype in self._typed and 0 < nbytes <= self.max_bytes and nbytes % 4 == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group's ranks, as a new tensor (`x` is left as it was).
        Only for `x` that `should_use` accepts; every rank must call it with the same shape.
        Safe inside CUDA graph capture: the buffer and peer addresses never move."""
        staged = self._typed[x.dtype][: x.numel()].view(x.shape)
        if self._fused_copy and _aligned_16(x):
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", self.group_name)
        staged.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)


def _aligned_16(x: torch.Tensor) -> bool:
    """The fused copy needs `x` aligned as the staging buffer is (16 bytes at offset 0)."""
    offset = x.storage_offset() * x.element_size()
    return x.data_ptr() % 16 == 0 and offset % 16 == 0 and x.nbytes % 16 == 0


def _allocate(device: torch.device, max_bytes: int) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem.empty(-(-max_bytes // 16) * 16, dtype=torch.uint8, device=device)


def _rendezvous(buffer: torch.Tensor, group: object) -> object:
    """Map every rank's buffer into every other rank (a collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    # Without it torch binds the buffers to an NVLink multicast object on GPUs that have one.
    envs.disable_symm_mem_multicast()
    handle = symm_mem.rendezvous(buffer, group.group_name)
    if getattr(handle, "multicast_ptr", 0):
        raise RuntimeError("torch bound the buffer to an NVLink multicast object")
    return handle


def _attempt(what: str, fn, *args) -> tuple[object, str | None]:
    """(fn's result, None), or (None, why it failed)."""
    try:
        return fn(*args), None
    except Exception as e:
        return None, f"{what} failed: {type(e).__name__}: {e}"


def _missing_api() -> str | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"this torch has no torch.distributed._symmetric_memory ({e})"
    for name in ("empty", "rendezvous"):
        if not hasattr(symm_mem, name):
            return f"this torch's symmetric memory has no {name}()"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        return "this torch has no torch.ops.symm_mem.one_shot_all_reduce"
    return None


def _peer_access_problem(group: object, device: torch.device) -> str | None:
    """Why this rank's GPU cannot map its peers' memory, or None. A collective."""
    places: list[tuple[str, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, (socket.gethostname(), device.index), group=group)
    host = socket.gethostname()
    if any(place[0] != host for place in places):
        return "the group spans more than one host"
    # The same index in another process means per-process CUDA_VISIBLE_DEVICES: then the
    # rendezvous itself finds out whether the devices can reach each other.
    peers = {index for _, index in places if index != device.index}
    for index in sorted(peers):
        if index < torch.cuda.device_count() and not torch.cuda.can_device_access_peer(
            device, index
        ):
            return f"GPU {device.index} has no peer access to GPU {index}"
    return None


def _all_ranks_agree(group: object, device: torch.device, reason: str | None) -> bool:
    """True when no rank has a reason to give up; logs this rank's reason, or that another
    rank gave up."""
    ok = torch.tensor([0 if reason else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if reason:
        logger.warning("custom all-reduce not used: %s", reason)
    elif not ok.item():
        logger.warning("custom all-reduce not used: another rank could not set it up")
    return bool(ok.item())
