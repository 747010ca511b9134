"""`NixlTransport`: KV pages between engines with NIXL (`pip install "inferengine[nixl]"`).

Each engine registers its KV cache tensors with a NIXL agent (UCX backend: RDMA, NVLink, CUDA
IPC, shared memory or TCP, whichever reaches) and prepares one descriptor per (layer, K or V,
page). A producer publishes nothing but where to read: its agent's metadata (a few hundred
bytes, base64 in the `kv_transfer_params`, so no side channel is needed), its tensors' base
addresses and page count. A consumer adds that agent once, then READs the producer's pages into
the pages it allocated, one request per fetch, with the producer's request id as the
notification NIXL delivers when the read completes: that is how the producer learns it may free
them. A fetch with no pages to read still notifies.

On a GPU the read is posted once the steps in flight before it are done (an event on the main
stream), so no late write of theirs lands in the fresh pages.
"""

from __future__ import annotations

import base64
import importlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inferengine.core.sched_output import KVFetch
from inferengine.kv_transfer.base import kv_layout
from inferengine.logger import init_logger

logger = init_logger(__name__)

NAME = "NixlConnector"


def import_nixl() -> Any:
    """NIXL's Python API: the `nixl` meta package, else a CUDA variant's module directly."""
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise ImportError("NIXL is not installed (nixl, nixl-cu13 or nixl-cu12)")


@dataclass
class _Read:
    fetch: KVFetch
    remote: str
    ready: torch.cuda.Event | None = None  # the main stream's steps before it, on a GPU
    handle: Any = None
    extra: dict = field(default_factory=dict)


class NixlTransport:
    name = NAME

    def __init__(self, kv_caches: list[torch.Tensor], engine_id: str):
        nixl = import_nixl()
        self.nixl = nixl
        self.device = kv_caches[0].device
        self.cuda = self.device.type == "cuda"
        self.mem = "VRAM" if self.cuda else "DRAM"
        self.dev_id = (self.device.index or 0) if self.cuda else 0
        self.agent_name = f"inferengine-{engine_id}"
        self.agent = nixl.nixl_agent(self.agent_name, nixl.nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend here")
        self.layout = kv_layout(kv_caches)
        self.num_blocks = kv_caches[0].shape[1]
        self.bases = [c.data_ptr() for c in kv_caches]
        self.block_bytes = [c[0, 0].numel() * c.element_size() for c in kv_caches]
        self.registered = self.agent.register_memory(list(kv_caches))
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._descs(self.bases, self.num_blocks, self.dev_id), self.mem
        )
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.remotes: dict[str, tuple[str, Any, int]] = {}  # metadata -> name, dlist, pages
        self.reads: dict[str, _Read] = {}
        self.finished: dict[str, bool] = {}

    def _descs(self, bases: list[int], num_blocks: int, dev_id: int) -> np.ndarray:
        """One (address, bytes, device) row per (layer, K or V, page), in that order."""
        rows = []
        pages = np.arange(num_blocks, dtype=np.int64)
        for base, nbytes in zip(bases, self.block_bytes, strict=True):
            for kv in (0, 1):
                addr = base + (kv * num_blocks + pages) * nbytes
                rows.append(
                    np.stack([addr, np.full_like(addr, nbytes), np.full_like(addr, dev_id)], 1)
                )
        return np.concatenate(rows)

    def _indices(self, block_ids: list[int], num_blocks: int) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        layers = len(self.block_bytes) * 2
        return (np.arange(layers)[:, None] * num_blocks + ids[None, :]).reshape(-1).astype(np.int32)

    # ---- producer --------------------------------------------------------------------------

    def publish(self, req_id: str, block_ids: list[int]) -> tuple[dict, bool]:
        return {
            "transport": NAME,
            "kv_layout": self.layout,
            "nixl_agent": self.agent_name,
            "nixl_metadata": self.metadata,
            "nixl_base_addrs": self.bases,
            "nixl_num_blocks": self.num_blocks,
            "nixl_mem": self.mem,
            "nixl_device": self.dev_id,
        }, False

    # ---- consumer --------------------------------------------------------------------------

    def _remote(self, params: dict) -> tuple[str, Any, int]:
        metadata = params["nixl_metadata"]
        known = self.remotes.get(metadata)
        if known is not None:
            return known
        name = params["nixl_agent"]
        for old, (old_name, dlist, _) in list(self.remotes.items()):
            if old_name == name:  # the producer restarted under the same engine id
                dlist.release()
                self.agent.remove_remote_agent(name)
                del self.remotes[old]
        name = self.agent.add_remote_agent(base64.b64decode(metadata))
        name = name.decode() if isinstance(name, bytes) else name
        num_blocks = int(params["nixl_num_blocks"])
        bases = [int(b) for b in params["nixl_base_addrs"]]
        descs = self._descs(bases, num_blocks, int(params.get("nixl_device", 0)))
        dlist = self.agent.prep_xfer_dlist(name, descs, params.get("nixl_mem", "DRAM"))
        self.remotes[metadata] = (name, dlist, num_blocks)
        return self.remotes[metadata]

    def start_fetch(self, fetch: KVFetch) -> None:
        params = fetch.params
        try:
            if params.get("transport") != NAME or params.get("kv_layout") != self.layout:
                raise ValueError("another transport or KV layout")
            remote, _, _ = self._remote(params)
        except Exception as e:
            logger.warning("KV transfer %s: cannot reach the producer (%s)", fetch.req_id, e)
            self.finished[fetch.req_id] = False
            return
        read = _Read(fetch, remote)
        if self.cuda and fetch.block_ids:
            read.ready = torch.cuda.current_stream(self.device).record_event()
        self.reads[fetch.req_id] = read
        self._post(read)

    def _post(self, read: _Read) -> None:
        """Post the read once the steps before it are done (at once on the CPU)."""
        if read.ready is not None and not read.ready.query():
            return
        read.ready = None
        fetch = read.fetch
        notif = str(fetch.params["remote_request_id"]).encode()
        try:
            if not fetch.block_ids:
                self.agent.send_notif(read.remote, notif)
                self._end(fetch.req_id, True)
                return
            _, dlist, remote_blocks = self._remote(fetch.params)
            read.handle = self.agent.make_prepped_xfer(
                "READ",
                self.local,
                self._indices(fetch.block_ids, self.num_blocks),
                dlist,
                self._indices(fetch.remote_block_ids, remote_blocks),
                notif,
            )
            if self.agent.transfer(read.handle) == "ERR":
                self._end(fetch.req_id, False)
        except Exception as e:
            logger.warning("KV transfer %s: the read failed to start (%s)", fetch.req_id, e)
            self._end(fetch.req_id, False)

    def _end(self, req_id: str, ok: bool) -> None:
        read = self.reads.pop(req_id, None)
        if read is not None and read.handle is not None:
            try:
                read.handle.release()
            except Exception as e:  # still active: NIXL could not cancel it
                self.reads[req_id] = read
                logger.debug("KV transfer %s: release failed (%s)", req_id, e)
                return
        self.finished[req_id] = ok

    def cancel(self, req_id: str) -> bool:
        read = self.reads.get(req_id)
        if read is None:
            self.finished.pop(req_id, None)
            return True
        self._end(req_id, False)
        if req_id in self.reads:  # NIXL could not cancel it yet
            return False
        self.finished.pop(req_id, None)
        return True

    # ---- both ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self.reads)

    def poll(self) -> tuple[list[str], dict[str, bool]]:
        released = [
            msg.decode(errors="replace")
            for messages in self.agent.get_new_notifs().values()
            for msg in messages
        ]
        for req_id, read in list(self.reads.items()):
            if read.handle is None:
                self._post(read)
                continue
            state = self.agent.check_xfer_state(read.handle)
            if state != "PROC":
                self._end(req_id, state == "DONE")
        finished, self.finished = self.finished, {}
        return released, finished

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self.registered)
        except Exception as e:  # shutting down anyway
            logger.debug("NIXL deregistration failed: %s", e)
