"""`HostTier`: which host-memory slots hold which KV pages, by prefix hash (the CPU tier).

The worker owns the bytes; this class only decides. A page evicted from the GPU pool is copied
into a slot before its GPU page is reused, and a prefix hit here is loaded back into a fresh GPU
page instead of being recomputed. Slots are reused least recently used first, leased ones (a
session that asked to be kept) only after every unleased one; a slot that a copy of the current
step reads or writes is never given away in that step.

KV events: with `kv_events` set to a list (a data-parallel replica sets the block pool's), every
change to which hashes the tier holds is appended in order: (KV_CPU_STORED, hash) when a slot is
reserved for it (its copy runs before the step that could read it), (KV_CPU_REMOVED, hash) when
its slot goes to another page, (KV_CPU_CLEARED, b"") when all are dropped.
"""

from __future__ import annotations

from collections import OrderedDict

from inferengine.core.block_pool import KV_CPU_CLEARED, KV_CPU_REMOVED, KV_CPU_STORED, KVEvent
from inferengine.core.hashing import BlockHash


class HostTier:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        # hash -> slot, least recently used first; leased entries wait in their own order.
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()
        self._leased: OrderedDict[BlockHash, int] = OrderedDict()
        self._lease_until: dict[BlockHash, float] = {}
        self._busy: set[int] = set()  # slots a copy of this step uses
        self.num_evicted_leased = 0
        self.kv_events: list[KVEvent] | None = None  # see the module docstring

    def __len__(self) -> int:
        return len(self._lru) + len(self._leased)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru or block_hash in self._leased

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the tier holds (what replaying its KV events gives)."""
        return [*self._lru, *self._leased]

    @property
    def num_leased(self) -> int:
        return len(self._leased)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding `block_hash`, marked busy for this step and recently used."""
        for order in (self._lru, self._leased):
            slot = order.get(block_hash)
            if slot is not None:
                order.move_to_end(block_hash)
                self._busy.add(slot)
                return slot
        return None

    def reserve(
        self, block_hash: BlockHash, lease_until: float = 0.0, evict: bool = True
    ) -> int | None:
        """A slot for a page about to be copied here, or None when there is none: every slot
        is busy, or (`evict=False`) none is free."""
        slot = self._free.pop() if self._free else (self._evict() if evict else None)
        if slot is None:
            return None
        self._busy.add(slot)
        self._place(block_hash, slot, lease_until)
        if self.kv_events is not None:
            self.kv_events.append((KV_CPU_STORED, block_hash))
        return slot

    def lease(self, block_hash: BlockHash, until: float) -> None:
        """Extend the lease of a page held here (a session that used it again)."""
        slot = self._lru.pop(block_hash, None)
        if slot is None:
            slot = self._leased.pop(block_hash, None)
        if slot is not None:
            self._place(block_hash, slot, max(until, self._lease_until.get(block_hash, 0.0)))

    def expire_leases(self, now: float) -> None:
        for block_hash in [h for h in self._leased if self._lease_until[h] <= now]:
            slot = self._leased.pop(block_hash)
            del self._lease_until[block_hash]
            self._lru[block_hash] = slot
            self._lru.move_to_end(block_hash, last=False)  # stale: first to go

    def end_step(self) -> None:
        self._busy.clear()

    def clear(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._lru.clear()
        self._leased.clear()
        self._lease_until.clear()
        self._busy.clear()
        if self.kv_events is not None:
            self.kv_events.append((KV_CPU_CLEARED, b""))

    def _place(self, block_hash: BlockHash, slot: int, lease_until: float) -> None:
        if lease_until > 0.0:
            self._leased[block_hash] = slot
            self._lease_until[block_hash] = lease_until
        else:
            self._lru[block_hash] = slot

    def _evict(self) -> int | None:
        for order in (self._lru, self._leased):
            for block_hash, slot in order.items():
                if slot in self._busy:
                    continue
                del order[block_hash]
                if order is self._leased:
                    del self._lease_until[block_hash]
                    self.num_evicted_leased += 1
                if self.kv_events is not None:
                    self.kv_events.append((KV_CPU_REMOVED, block_hash))
                return slot
        return None
