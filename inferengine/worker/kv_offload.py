"""`HostKVTier`: the bytes of the CPU tier on one rank, and the copies the scheduler lists.

One host tensor per KV cache tensor, with the same page layout (`[2, slots, block, heads,
dim]`), pinned when the cache is on a GPU. Each step first saves pages into slots (offloads),
then fills pages from slots (loads), then runs; the scheduler never lists a slot that a load
reads as the target of an offload of the same step, so this order is always right. On a GPU the
copies run on their own stream and the step waits for them only where it must. Pages are
copied as stored: an fp8 cache's as their bytes (torch has no fp8 `index_copy_` on the CPU).
"""

from __future__ import annotations

import torch

from inferengine.kernels.kv_quant import as_bytes
from inferengine.logger import init_logger

logger = init_logger(__name__)


class HostKVTier:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int):
        device = kv_caches[0].device
        self.device = device
        pin = device.type == "cuda"
        self.host = [
            torch.empty((t.shape[0], num_slots, *t.shape[2:]), dtype=t.dtype, pin_memory=pin)
            for t in kv_caches
        ]
        self.stream = torch.cuda.Stream(device) if pin else None
        total = sum(t.numel() * t.element_size() for t in self.host)
        logger.info("CPU KV tier: %d pages, %.2f GiB of host memory", num_slots, total / 2**30)

    def copy(
        self,
        kv_caches: list[torch.Tensor],
        offloads: list[tuple[int, int]],
        loads: list[tuple[int, int]],
    ) -> None:
        """Save `offloads` (page, slot), then fill `loads` (slot, page); the current stream
        waits for both before the step that follows reads or overwrites those pages."""
        if not offloads and not loads:
            return
        if self.stream is None:
            self._copy(kv_caches, offloads, loads)
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # the pages hold what earlier steps wrote
        with torch.cuda.stream(self.stream):
            self._copy(kv_caches, offloads, loads)
        main.wait_stream(self.stream)

    def write(self, slots: list[int], pages: list[torch.Tensor]) -> None:
        """Fill `slots` with imported pages (one tensor per KV cache tensor)."""
        if self.stream is not None:
            torch.cuda.synchronize(self.device)  # no copy of an earlier step still reads them
        index = torch.tensor(slots)
        for host, part in zip(self.host, pages, strict=True):
            assert part.dtype == host.dtype, "pages must come in the cache's dtype"
            as_bytes(host).index_copy_(1, index, as_bytes(part))

    def _copy(self, kv_caches, offloads, loads) -> None:
        dev = self.device
        if offloads:
            pages = torch.tensor([p for p, _ in offloads], device=dev)
            slots = torch.tensor([s for _, s in offloads])
            for cache, host in zip(kv_caches, self.host, strict=True):
                as_bytes(host).index_copy_(1, slots, as_bytes(cache).index_select(1, pages).cpu())
        if loads:
            slots = torch.tensor([s for s, _ in loads])
            pages = torch.tensor([p for _, p in loads], device=dev)
            for cache, host in zip(kv_caches, self.host, strict=True):
                part = as_bytes(host).index_select(1, slots)
                as_bytes(cache).index_copy_(1, pages, part.to(dev, non_blocking=part.is_pinned()))


def read_pages(
    kv_caches: list[torch.Tensor], tier: HostKVTier | None, locations: list[tuple[str, int]]
) -> list[torch.Tensor]:
    """Host copies of pages at `locations` (("gpu", page) or ("host", slot)), in that order:
    one `[2, len(locations), ...]` tensor per KV cache tensor."""
    if kv_caches[0].is_cuda:
        torch.cuda.synchronize(kv_caches[0].device)
    out = []
    for i, cache in enumerate(kv_caches):
        parts = []
        for where, index in locations:
            source = cache if where == "gpu" else tier.host[i]  # type: ignore[union-attr]
            parts.append(source[:, index].to("cpu"))
        out.append(torch.stack(parts, dim=1))
    return out
