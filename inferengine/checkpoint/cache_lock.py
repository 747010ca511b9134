"""One lock per model-cache folder, taken by every process that writes it: a conversion into it
(an alias's first use, a .gguf's) and the float weights a lean folder writes on demand
(`model/loader/gguf_floats.py`). Whoever holds it finds the folder as the last holder left it,
so it decides what to write (nothing, if another process wrote it meanwhile) only once it holds
it.

The lock is `flock` on `.{name}.lock` beside the folder (in it, if the parent is read-only), so
it outlives the folder being replaced, and the kernel releases it when its holder dies, SIGKILL
included: no one waits on a dead process. Every writer writes temporary files only while it
holds the lock, so the temporary files of theirs a holder finds are a dead writer's, and it
deletes them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from inferengine.logger import init_logger

logger = init_logger(__name__)

_held = threading.local()  # the lock paths this thread holds: taking one again does not block


def lock_path(folder: Path) -> Path:
    parent = folder.parent
    if os.access(parent, os.W_OK) or not os.access(folder, os.W_OK):
        return parent / f".{folder.name}.lock"
    return folder / ".inferengine.lock"  # a converted folder the user put under a read-only one


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold the lock on writing `folder` (waiting for another process that holds it)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(folder)
    held: set[str] = _held.__dict__.setdefault("paths", set())
    if str(path) in held:  # a second open file would wait for this one: a deadlock
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish writing %s", folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        held.add(str(path))
        try:
            yield
        finally:
            held.discard(str(path))
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_leftovers(folder: Path, temp_files: tuple[str, ...] = ()) -> None:
    """Under `folder_lock(folder)`: delete what writers killed while holding it left: their
    temporary folders beside it (a conversion's, a download's, the earlier conversion it was
    replacing) and the files in it that match `temp_files` (glob patterns)."""
    patterns = (f".{folder.name}.tmp-*", f".{folder.name}.old-*", f".{folder.name}.download-*")
    paths = [p for pattern in patterns for p in folder.parent.glob(pattern)]
    if folder.is_dir():
        paths += [p for pattern in temp_files for p in folder.glob(pattern)]
    for path in paths:
        logger.info("deleting %s, left by a process that stopped while writing it", path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
