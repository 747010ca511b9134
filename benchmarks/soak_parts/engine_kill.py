"""The kill midway: SIGKILL the engine core, then watch the API server exit non-zero within
--exit-within-s (stopped if it does not), the supervisor bring it back, and the requests that
were in flight end soon after the kill rather than hang."""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

from .checks import check
from .server_probes import scrape
from .supervisor import Supervisor, find_engine_core
from .traffic import Traffic


async def kill_engine(t: Traffic, sup: Supervisor, base_url: str, args: argparse.Namespace):
    """SIGKILL the engine core; watch the server exit and the supervisor restart it. Returns
    (the kill's record with its checks, the kill window in run seconds)."""
    run = sup.incarnation
    api_pid = sup.runs[run]["pid"]
    _, stats = await scrape(base_url)
    core = find_engine_core(api_pid, (stats or {}).get("engine_pid"))
    checks: dict[str, dict[str, Any]] = {}
    kill: dict[str, Any] = {"api_pid": api_pid, "engine_core_pid": core, "checks": checks}
    checks["engine_core_found"] = check(core is not None, core)
    if core is None:
        return kill, None
    kill_mono = time.monotonic()
    os.kill(core, signal.SIGKILL)
    kill["killed_s"] = sup.now()
    t_kill = kill_mono - t.t0
    exited = await sup.wait_exit(run, args.exit_wait_s)
    if exited:
        r = sup.runs[run]
        kill["server_exit_code"] = r["exit_code"]
        kill["server_exit_after_s"] = round(r["exited_s"] - t_kill, 3)
    else:  # still up (answering 503?): stop it so that the run can go on
        kill["server_exit_code"] = None
        kill["forced_stop"] = True
        sup.signal_current(signal.SIGTERM)
        if not await sup.wait_exit(run, 10.0):
            sup.signal_current(signal.SIGKILL, group=True)
            await sup.wait_exit(run, 10.0)
    after = kill.get("server_exit_after_s")
    checks["server_exited_nonzero_after_engine_kill"] = check(
        exited and kill["server_exit_code"] not in (0, None) and after <= args.exit_within_s,
        {"exit_code": kill["server_exit_code"], "after_s": after},
        f"non-zero within {args.exit_within_s} s",
        note="" if exited else f"still running {args.exit_wait_s} s after the kill; stopped",
    )
    restarted = await sup.wait_ready(run + 1, args.startup_timeout_s)
    ready_s = sup.runs[-1]["ready_s"] if restarted else None
    kill["restart_ready_s"] = ready_s
    kill["restart_ready_after_s"] = round(ready_s - t_kill, 3) if restarted else None
    kill["restart_ready_mono"] = t.t0 + ready_s if restarted else None
    checks["server_restarted"] = check(restarted, kill["restart_ready_after_s"])
    window_end = ready_s if restarted else float("inf")
    # Requests in flight at the kill should end soon after it (failed, not hung).
    in_flight = [r for r in t.records if r.start <= t_kill and (r.end == 0 or r.end > t_kill)]
    lags = [(r.end if r.end else t.now()) - t_kill for r in in_flight]
    kill["in_flight_at_kill"] = len(in_flight)
    worst = round(max(lags), 3) if lags else 0.0
    limit = args.exit_within_s + 2
    checks["in_flight_at_kill_ended"] = check(worst <= limit, worst, f"<= {limit} s")
    kill["window_s"] = [round(t_kill, 3), window_end if restarted else None]
    return kill, (t_kill, window_end)
