"""The clients: each loops over requests of kinds drawn by weight until the traffic stops,
backing off while the server is down and reconnecting to a restarted one; a warm pass sends one
request of every kind; a progress line every minute."""

from __future__ import annotations

import asyncio
import contextlib
import random

import httpx

from .clock import log
from .outcomes import Record
from .payloads import KINDS
from .request_kinds import HANDLERS, do_agent_session
from .traffic import Traffic, guarded, make_client


async def run_one(t: Traffic, c: httpx.AsyncClient, rng: random.Random, kind: str) -> Record:
    """One request of `kind` (an agent session: all its turns), recorded in `t.records`."""
    rec = Record(kind, t.now())
    t.records.append(rec)
    if kind == "agent_session":
        return await do_agent_session(t, c, rng, rec)
    await guarded(rec, t, HANDLERS[kind](t, c, rng, rec))
    return rec


async def client_loop(t: Traffic, index: int) -> None:
    """Client `index`: requests until the traffic stops, a fresh connection pool for each server
    run, and a pause while the server is failing or restarting."""
    rng = random.Random(t.args.seed * 1000 + index)
    kinds = list(KINDS)
    weights = [KINDS[k] for k in kinds]
    incarnation = t.supervisor.incarnation
    c = make_client(t)
    try:
        while not t.done():
            if t.supervisor.incarnation != incarnation:  # a new server: no stale connections
                incarnation = t.supervisor.incarnation
                await c.aclose()
                c = make_client(t)
            rec = await run_one(t, c, rng, rng.choices(kinds, weights)[0])
            if rec.error in ("connect", "http") or (rec.status or 0) >= 500:
                # The server is failing or down: back off, and wait while it restarts.
                await asyncio.sleep(0.5)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(t.supervisor.ready.wait(), 60.0)
    finally:
        await c.aclose()


async def warm_pass(t: Traffic) -> None:
    """One request of every kind, one after another (grammars compiled, caches filled)."""
    rng = random.Random(t.args.seed - 1)
    async with make_client(t) as c:
        for kind in KINDS:
            if t.done():
                return
            rec = await run_one(t, c, rng, kind)
            outcome = "ok" if rec.ok else f"{rec.status or rec.error} {rec.detail[:60]}"
            log(t.t0, f"  warm pass: {kind} {rec.end - rec.start:.1f} s ({outcome})")


async def progress(t: Traffic, every_s: float = 60.0) -> None:
    """A line of counts every `every_s` seconds."""
    while True:
        await asyncio.sleep(every_s)
        ok = sum(r.ok for r in t.records)
        log(t.t0, f"{len(t.records)} requests, {ok} ok (kill window not yet applied)")
