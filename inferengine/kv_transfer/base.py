"""`KVTransport`: what moves a prompt's KV pages between engines, and the choice of one.

A transport sees an engine's KV cache tensors (`[2, pages, block, kv heads, head dim]` per
layer) and page ids; it never decides which pages (the scheduler does) or when to give up (the
worker half does, through `cancel`). Two ways to move pages, both behind this protocol:

- pull (built): the producer keeps the pages where they are and the consumer reads them into
  pages it allocated (NIXL READ of the producer's registered cache; the page file of the shared
  memory transport, written once the prompt is computed).
- push (not built): the consumer allocates pages first and the producer writes into them, layer
  by layer while its prefill runs. That needs the router to ask the consumer first and hand its
  page ids to the producer: a change of the HTTP contract, left for when GPU numbers say the
  overlap pays.
"""

from __future__ import annotations

from typing import Protocol

import torch

from inferengine.core.sched_output import KVFetch


class KVTransport(Protocol):
    name: str

    def publish(self, req_id: str, block_ids: list[int]) -> tuple[dict, bool]:
        """Make pages `block_ids` (computed by now, in stream order) fetchable as `req_id`:
        the transport's keys of the `kv_transfer_params`, and whether the device pages are
        free already (their bytes were pushed elsewhere)."""
        ...

    def start_fetch(self, fetch: KVFetch) -> None:
        """Start copying the producer's pages into `fetch.block_ids` (may finish in `poll`)."""
        ...

    def poll(self) -> tuple[list[str], dict[str, bool]]:
        """Producer transfers done with (the consumer took the pages), and the fetches that
        ended since the last call, with whether each succeeded."""
        ...

    def cancel(self, req_id: str) -> bool:
        """Give up a fetch; True once nothing writes its pages any more."""
        ...

    @property
    def busy(self) -> bool:
        """Whether fetches are in flight (the worker then polls an idle engine)."""
        ...

    def close(self) -> None: ...


def page_major(cache: torch.Tensor) -> torch.Tensor:
    """A `[2, pages, ...]` cache as `[pages, 2, bytes]` (a view: writes reach the cache)."""
    return cache.view(torch.uint8).reshape(2, cache.shape[1], -1).transpose(0, 1)


def kv_layout(kv_caches: list[torch.Tensor]) -> list:
    """What must match between producer and consumer for pages to be copied as bytes: layers,
    each one's page shape and dtype."""
    return [[list(c[:, 0].shape), str(c.dtype).removeprefix("torch.")] for c in kv_caches]


def page_bytes(kv_caches: list[torch.Tensor]) -> int:
    """One page of every layer, in bytes."""
    return sum(c[:, 0].numel() * c.element_size() for c in kv_caches)
