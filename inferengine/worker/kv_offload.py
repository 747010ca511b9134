"""`HostKVTier`: the bytes of the CPU tier on one rank, and the copies the scheduler lists.

A slot holds one page of every layer, back to back as bytes (`[slots, slot_bytes]`), so a page
moves between host and GPU as one contiguous copy whatever the layer count. On a GPU the host
buffer is pinned where it lies (no rounding up of the size), and the copies run on their own
stream through a small GPU staging buffer: a chunk of pages is gathered from every layer's cache
into staging, then copied to its slots (saves), or copied from its slots into staging, then
scattered into the caches (loads). The host thread only launches; nothing waits on the GPU.

Each step runs its saves of pages the step reuses, then its loads, and the step waits for both
on the GPU. Write-backs (free pages saved ahead of eviction, which this step does not touch)
run after them and only the next step waits for them, so they overlap this step's compute. The
scheduler never lists a slot that a load reads as the target of a save of the same step.
Pages are copied as stored (an fp8 cache's as its bytes).
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Callable
from functools import partial
from itertools import accumulate

import torch

from inferengine.errors import ConfigError
from inferengine.logger import init_logger

logger = init_logger(__name__)

STAGING_BYTES = 64 * 2**20  # GPU memory the copies go through, a chunk of pages at a time

Copies = list[tuple[int, int]]


def _pinned_empty(num_slots: int, slot_bytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """Host memory the GPU copies to and from asynchronously, and the call that unpins it.

    Fresh pages of its own (an anonymous mapping), registered with CUDA in place: torch's
    pinned allocator rounds each allocation up to a power of two (24 GiB would lock 32). The
    pages must be unregistered before they are unmapped; otherwise memory that malloc later
    hands to ordinary tensors would still count as pinned, and copies torch makes from it with
    `non_blocking=True` would run after the tensor is gone.
    """
    size = num_slots * slot_bytes
    mapping = mmap.mmap(-1, size)
    host = torch.frombuffer(mapping, dtype=torch.uint8).view(num_slots, slot_bytes)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(host.data_ptr(), size, 0))
    if err != 0:
        raise ConfigError(
            f"could not pin {size / 2**30:.2f} GiB of host memory for the CPU KV tier (CUDA "
            f"error {err}); lower --kv-offloading-size."
        )
    return host, partial(cudart.cudaHostUnregister, host.data_ptr())


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive slots in `slots`."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            j, first, n = runs[-1]
            runs[-1] = (j, first, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs


class HostKVTier:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int):
        self.device = kv_caches[0].device
        self.page_shapes = [t[:, 0].shape for t in kv_caches]  # [2, block, heads, dim]
        self.dtypes = [t.dtype for t in kv_caches]
        self.page_bytes = [t[:, 0].numel() * t.element_size() for t in kv_caches]
        self.offsets = [0, *accumulate(self.page_bytes)][:-1]
        self.slot_bytes = sum(self.page_bytes)
        cuda = self.device.type == "cuda"
        if cuda:
            self.host, unpin = _pinned_empty(num_slots, self.slot_bytes)
            weakref.finalize(self, unpin)
            self.stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device)
            chunk = max(1, min(num_slots, STAGING_BYTES // self.slot_bytes))
            self.staging: torch.Tensor | None = torch.empty(
                (chunk, self.slot_bytes), dtype=torch.uint8, device=self.device
            )
        else:
            self.host = torch.empty((num_slots, self.slot_bytes), dtype=torch.uint8)
            self.stream = None
            self.staging = None  # CPU copies go straight to their slots
        self._writebacks_done: torch.cuda.Event | None = None
        logger.info(
            "CPU KV tier: %d pages, %.2f GiB of host memory",
            num_slots,
            num_slots * self.slot_bytes / 2**30,
        )

    def page(self, layer: int, slot: int) -> torch.Tensor:
        """Slot `slot`'s page of layer `layer`: `[2, block, heads, dim]` in the cache dtype."""
        part = self.host[slot, self.offsets[layer] : self.offsets[layer] + self.page_bytes[layer]]
        return part.view(self.dtypes[layer]).view(self.page_shapes[layer])

    def copy(
        self,
        kv_caches: list[torch.Tensor],
        offloads: Copies,
        loads: Copies,
        writebacks: Copies | None = None,
    ) -> None:
        """Save `offloads` (page, slot), then fill `loads` (slot, page), before this step;
        save `writebacks` (page, slot) before the next one."""
        if self.stream is None:
            self._save_here(kv_caches, [*offloads, *(writebacks or [])])
            self._load_here(kv_caches, loads)
            return
        main = torch.cuda.current_stream(self.device)
        if self._writebacks_done is not None:
            main.wait_event(self._writebacks_done)
            self._writebacks_done = None
        if not (offloads or loads or writebacks):
            return
        self.stream.wait_stream(main)  # the pages hold what earlier steps wrote
        offloads = sorted(offloads, key=lambda c: c[1])
        loads = sorted(loads)
        writebacks = sorted(writebacks or [], key=lambda c: c[1])
        with torch.cuda.stream(self.stream):
            pages = self._page_ids([p for p, _ in offloads], [p for _, p in loads],
                                   [p for p, _ in writebacks])  # fmt: skip
            self._save(kv_caches, offloads, pages[0])
            self._load(kv_caches, loads, pages[1])
            if offloads or loads:
                main.wait_event(self.stream.record_event())
            if writebacks:
                self._save(kv_caches, writebacks, pages[2])
                self._writebacks_done = self.stream.record_event()

    def write(self, slots: list[int], pages: list[torch.Tensor]) -> None:
        """Fill `slots` with imported pages (one `[2, n, ...]` tensor per KV cache tensor)."""
        if self.stream is not None:
            torch.cuda.synchronize(self.device)  # no copy of an earlier step still uses them
        index = torch.tensor(slots)
        for layer, part in enumerate(pages):
            assert part.dtype == self.dtypes[layer], "pages must come in the cache's dtype"
            self._layer_pages(self.host, layer).index_copy_(0, index, _page_major(part))

    # ---- copies, in bytes ------------------------------------------------------------------

    def _page_ids(self, *groups: list[int]) -> list[torch.Tensor]:
        """The GPU page ids of each group, on the device through one asynchronous copy (a
        tensor built straight on the device would make the host wait for the stream)."""
        ids = torch.tensor([p for group in groups for p in group], dtype=torch.int64)
        ids = ids.pin_memory().to(self.device, non_blocking=True)
        return list(ids.split([len(group) for group in groups]))

    def _save(self, kv_caches: list[torch.Tensor], copies: Copies, pages: torch.Tensor) -> None:
        """Pages to slots through staging, a chunk at a time (`copies` sorted by slot)."""
        chunk = len(self.staging)
        for start in range(0, len(copies), chunk):
            stage = self.staging[: len(copies[start : start + chunk])]
            ids = pages[start : start + chunk]
            for layer, cache in enumerate(kv_caches):
                self._layer_pages(stage, layer).copy_(_page_major(cache).index_select(0, ids))
            for i, slot, n in _runs([s for _, s in copies[start : start + chunk]]):
                self.host[slot : slot + n].copy_(stage[i : i + n], non_blocking=True)

    def _load(self, kv_caches: list[torch.Tensor], copies: Copies, pages: torch.Tensor) -> None:
        """Slots to pages through staging, a chunk at a time (`copies` sorted by slot)."""
        chunk = len(self.staging)
        for start in range(0, len(copies), chunk):
            stage = self.staging[: len(copies[start : start + chunk])]
            for i, slot, n in _runs([s for s, _ in copies[start : start + chunk]]):
                stage[i : i + n].copy_(self.host[slot : slot + n], non_blocking=True)
            ids = pages[start : start + chunk]
            for layer, cache in enumerate(kv_caches):
                _page_major(cache).index_copy_(0, ids, self._layer_pages(stage, layer))

    def _save_here(self, kv_caches: list[torch.Tensor], copies: Copies) -> None:
        """Pages to slots when the cache is in host memory too."""
        if copies:
            pages, slots = torch.tensor(copies).T
            for layer, cache in enumerate(kv_caches):
                page_major = _page_major(cache).index_select(0, pages)
                self._layer_pages(self.host, layer).index_copy_(0, slots, page_major)

    def _load_here(self, kv_caches: list[torch.Tensor], copies: Copies) -> None:
        if copies:
            slots, pages = torch.tensor(copies).T
            for layer, cache in enumerate(kv_caches):
                page_major = self._layer_pages(self.host, layer).index_select(0, slots)
                _page_major(cache).index_copy_(0, pages, page_major)

    def _layer_pages(self, slots: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer`'s page in each row of `slots` (the host tier or staging, `[n,
        slot_bytes]`) as `[n, 2, bytes]`: a view."""
        start = self.offsets[layer]
        return slots[:, start : start + self.page_bytes[layer]].view(len(slots), 2, -1)


def _page_major(cache: torch.Tensor) -> torch.Tensor:
    """A `[2, pages, ...]` cache as `[pages, 2, bytes]` (a view: writes reach the cache)."""
    return cache.view(torch.uint8).reshape(2, cache.shape[1], -1).transpose(0, 1)


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
            page = cache[:, index] if where == "gpu" else tier.page(i, index)  # type: ignore[union-attr]
            parts.append(page.to("cpu"))
        out.append(torch.stack(parts, dim=1))
    return out
