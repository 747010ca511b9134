"""`SharedMemoryTransport`: KV pages between engines on one host, through files in /dev/shm.

The producer writes a published prompt's pages, page-major (one page of every layer back to
back, as the CPU tier's slots), into a file named by the engine id and request id, written
under a temporary name and renamed, so a consumer sees it whole or not at all. The device
pages are free again at once (the bytes were pushed into host memory). The consumer reads the
pages it wants into the pages it allocated and deletes the file: that is how it says it has
them. Files no consumer took are deleted after the hold timeout, and at shutdown; a file
named by a process that is gone (a killed engine) is deleted when the next engine starts.

On a GPU the producer's copy waits for the step's forward (one host sync on a publishing step)
and the consumer's runs on a side stream behind the steps in flight. Page bytes never travel
over a socket; only the file's path travels, inside `kv_transfer_params`.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from inferengine.core.sched_output import KVFetch
from inferengine.errors import ConfigError
from inferengine.kv_transfer.base import kv_layout, page_bytes, page_major
from inferengine.logger import init_logger

logger = init_logger(__name__)

NAME = "SharedMemoryConnector"


@dataclass
class _Fetch:
    fetch: KVFetch
    done: torch.cuda.Event | None = None  # the side stream's copy, on a GPU
    keep: torch.Tensor | None = None  # the host bytes that copy reads


class SharedMemoryTransport:
    name = NAME

    def __init__(
        self, kv_caches: list[torch.Tensor], engine_id: str, directory: str, hold_timeout_s: float
    ):
        self.caches = kv_caches
        self.device = kv_caches[0].device
        self.layout = kv_layout(kv_caches)
        self.slot_bytes = page_bytes(kv_caches)
        self.layer_bytes = [c[:, 0].numel() * c.element_size() for c in kv_caches]
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConfigError(f"kv_transfer_config: kv_buffer_dir {directory!r} is not a folder.")
        self.prefix = f"inferengine-kv-p{os.getpid()}-{_safe(engine_id)}-"
        _sweep_dead(self.dir)
        self.hold_timeout_s = hold_timeout_s
        self.own: dict[str, tuple[Path, float]] = {}  # published files and when they expire
        self.fetches: dict[str, _Fetch] = {}
        self.finished: dict[str, bool] = {}
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- producer --------------------------------------------------------------------------

    def publish(self, req_id: str, block_ids: list[int]) -> tuple[dict, bool]:
        path = self.dir / f"{self.prefix}{_safe(req_id)}"
        ids = torch.tensor(block_ids, device=self.device)
        rows = [page_major(c).index_select(0, ids).reshape(len(block_ids), -1) for c in self.caches]
        data = torch.cat(rows, dim=1).cpu()  # waits for the forward that wrote the pages
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            data.numpy().tofile(f)
        os.replace(tmp, path)
        self.own[req_id] = (path, time.monotonic() + self.hold_timeout_s)
        return {"transport": NAME, "kv_layout": self.layout, "shm_path": str(path)}, True

    def _expire(self) -> None:
        now = time.monotonic()
        for req_id, (path, deadline) in list(self.own.items()):
            if deadline <= now:
                del self.own[req_id]
                if _unlink(path):
                    logger.warning("KV transfer: no consumer took %s in time; deleted", path.name)

    # ---- consumer --------------------------------------------------------------------------

    def start_fetch(self, fetch: KVFetch) -> None:
        self.fetches[fetch.req_id] = _Fetch(fetch)
        self._try(fetch.req_id)

    def _try(self, req_id: str) -> None:
        """Copy the pages if the file is there (whole); a bad file or layout fails the fetch."""
        entry = self.fetches[req_id]
        if entry.done is not None:
            if entry.done.query():
                self._end(req_id, True)
            return
        fetch = entry.fetch
        params = fetch.params
        if params.get("kv_layout") != self.layout:
            logger.warning("KV transfer %s: the producer's KV layout differs from ours", req_id)
            self._end(req_id, False)
            return
        path = self._path(params)
        if path is None:
            self._end(req_id, False)
            return
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed below, before the copy)
        except FileNotFoundError:
            return  # not written yet: try again next poll
        with f:
            size = os.fstat(f.fileno()).st_size
            if size % self.slot_bytes:
                self._end(req_id, False)
                return
            data = torch.empty((size // self.slot_bytes, self.slot_bytes), dtype=torch.uint8)
            f.readinto(memoryview(data.numpy()))
        position = {b: i for i, b in enumerate(params.get("remote_block_ids", []))}
        try:
            rows = data[[position[b] for b in fetch.remote_block_ids]]
        except (KeyError, IndexError):
            self._end(req_id, False)
            return
        _unlink(path)  # the consumer has the pages: the producer's file goes
        if not fetch.block_ids:  # local prefix hits cover every page: only the release
            self._end(req_id, True)
            return
        self._copy_in(entry, rows, fetch.block_ids)

    def _path(self, params: dict) -> Path | None:
        """The page file the params name, if it is one of ours to read and delete: in our
        folder, named as a producer names them (the params come over HTTP)."""
        name = str(params.get("shm_path", ""))
        path = Path(name)
        if path.parent != self.dir or not path.name.startswith("inferengine-kv-") or ".." in name:
            return None
        return path

    def _copy_in(self, entry: _Fetch, rows: torch.Tensor, block_ids: list[int]) -> None:
        if self.stream is None:
            self._scatter(rows, torch.tensor(block_ids))
            self._end(entry.fetch.req_id, True)
            return
        rows = rows.pin_memory()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # steps in flight
        with torch.cuda.stream(self.stream):
            ids = torch.tensor(block_ids).pin_memory().to(self.device, non_blocking=True)
            self._scatter(rows.to(self.device, non_blocking=True), ids)
            entry.done = self.stream.record_event()
        entry.keep = rows

    def _scatter(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        start = 0
        for cache, nbytes in zip(self.caches, self.layer_bytes, strict=True):
            part = rows[:, start : start + nbytes].reshape(len(ids), 2, -1)
            page_major(cache).index_copy_(0, ids, part)
            start += nbytes

    def _end(self, req_id: str, ok: bool) -> None:
        self.fetches.pop(req_id, None)
        self.finished[req_id] = ok

    def cancel(self, req_id: str) -> bool:
        entry = self.fetches.get(req_id)
        if entry is not None and entry.done is not None and not entry.done.query():
            return False  # a copy is under way: its pages are still being written
        path = self._path(entry.fetch.params) if entry is not None else None
        if path is not None:
            _unlink(path)
        self.fetches.pop(req_id, None)
        self.finished.pop(req_id, None)
        return True

    # ---- both ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self.fetches)

    def poll(self) -> tuple[list[str], dict[str, bool]]:
        self._expire()
        for req_id in list(self.fetches):
            self._try(req_id)
        finished, self.finished = self.finished, {}
        return [], finished

    def close(self) -> None:
        for path, _ in self.own.values():
            _unlink(path)
        self.own.clear()


def _safe(name: str) -> str:
    """A request or engine id as a file name part."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:200]


def _sweep_dead(directory: Path) -> None:
    """Delete page files of producers that are gone (their pid is in the name)."""
    for path in directory.glob("inferengine-kv-p*-*"):
        match = re.match(r"inferengine-kv-p(\d+)-", path.name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _unlink(path)
        except (PermissionError, OverflowError):
            pass  # alive under another user, or not a pid


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return False
