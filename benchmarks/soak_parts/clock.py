"""Run-relative time: progress lines stamped with the seconds since the run began, and sleeping
until a moment of the monotonic clock."""

from __future__ import annotations

import asyncio
import time


def log(t0: float, message: str) -> None:
    """A progress line on stdout, stamped with the seconds since the run began."""
    print(f"[soak +{time.monotonic() - t0:7.1f}s] {message}", flush=True)


async def wait_until(t_mono: float) -> None:
    """Sleep until `t_mono` on the monotonic clock (at once if it has passed)."""
    delay = t_mono - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
