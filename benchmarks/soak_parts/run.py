"""One soak run from start to finish: the supervised server, the warm pass, --duration-s of
traffic from the clients with an RSS baseline per server run, the engine kill midway and the
restart, then the end: the server idle, RSS growth, a clean stop, the requests classified and
every check recorded in the result dict."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from inferengine.bench.systems import free_port

from .checks import check, idle_check, rss_checks, traffic_checks
from .clients import client_loop, progress, warm_pass
from .clock import log, wait_until
from .engine_kill import kill_engine
from .outcomes import tally, traffic_summary
from .rss import RSSSampler, pick_samples, take_baseline
from .server_probes import end_state, wait_for_idle
from .supervisor import Supervisor, serve_command
from .traffic import Traffic


async def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The run's result: what was measured, `checks` and `passed`; server logs go to
    `workdir`. RuntimeError if the first server never became healthy."""
    # SIGTERM stops the run as Ctrl-C does: the servers are stopped on the way out.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = serve_command(args, port)
    t0 = time.monotonic()
    sup = Supervisor(cmd, base_url, workdir, args, t0)
    sup_task = asyncio.create_task(sup.run())
    sup_task.add_done_callback(
        lambda task: (
            task.cancelled()
            or task.exception() is None
            or log(t0, f"the supervisor failed: {task.exception()!r}")
        )
    )
    result: dict[str, Any] = {"server_command": " ".join(cmd[1:])}
    checks: dict[str, dict[str, Any]] = {}
    sampler = RSSSampler(sup, args.rss_interval_s)
    sampler_task = progress_task = None
    clients: list[asyncio.Task] = []
    warm_tasks: list[asyncio.Task] = []
    try:
        if not await sup.wait_ready(0, args.startup_timeout_s):
            raise RuntimeError(f"the server did not become healthy: {sup.runs}")
        async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as c:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
        t = Traffic(base_url, model, args, t0, sup)
        result["model"] = model
        sampler_task = asyncio.create_task(sampler.loop())
        progress_task = asyncio.create_task(progress(t))
        # One request of each kind first (grammars compiled, caches filled), then the clock.
        log(t0, f"serving {model} at {base_url}; warm pass (one request of each kind)")
        await warm_pass(t)
        result["warm_pass_s"] = round(sup.now() - sup.runs[0]["ready_s"], 3)
        log(
            t0,
            f"warm pass done in {result['warm_pass_s']} s; {args.duration_s:g} s of traffic "
            f"from {args.clients} clients",
        )
        start = time.monotonic()
        deadline = start + args.duration_s
        result["traffic_started_s"] = sup.now()
        clients = [asyncio.create_task(client_loop(t, i)) for i in range(args.clients)]
        kill_mono = start + args.kill_at * args.duration_s if args.kill_at is not None else None
        last = (kill_mono or deadline) - 1
        baselines = [await take_baseline(t, sampler, min(start + args.warmup_s, last), last)]
        log(t0, f"RSS baseline: {baselines[0]}")
        ends: list[dict | None] = []
        kill: dict[str, Any] = {}
        kill_window = None
        if kill_mono is not None:
            await wait_until(kill_mono)
            ends.append(sampler.sample("before kill"))
            log(t0, f"{len(t.records)} requests so far; killing the engine core")
            kill, kill_window = await kill_engine(t, sup, base_url, args)
            log(t0, f"kill: { ({k: v for k, v in kill.items() if k != 'checks'}) }")
            checks.update(kill.pop("checks"))
            if kill.get("restart_ready_mono") is not None:
                # The clients resume by themselves; a warm pass beside them, the baseline of
                # this run --warmup-s after it is healthy, and at least --min-after-restart-s
                # of traffic after that.
                warm_tasks.append(asyncio.create_task(warm_pass(t)))
                at = kill["restart_ready_mono"] + args.warmup_s
                last = max(at + 2 * args.warmup_s, deadline - args.min_after_restart_s)
                baselines.append(await take_baseline(t, sampler, at, last, warm_tasks))
                log(t0, f"RSS baseline of the restarted server: {baselines[-1]}")
                deadline = max(deadline, time.monotonic() + args.min_after_restart_s)
        await wait_until(deadline)
        t.stopped = True
        traffic_end = sup.now()
        log(t0, f"traffic stops ({len(t.records)} requests); waiting for the clients")
        await asyncio.wait(clients + warm_tasks, timeout=args.request_timeout_s + 15)
        stuck = sum(not c.done() for c in clients + warm_tasks)
        # No request left: nothing running or waiting, no KV page held by a request.
        metrics, stats = await wait_for_idle(base_url, args.settle_s)
        ends.append(sampler.sample("end"))
        result["end_state"] = end_state(metrics, stats)
        checks["no_request_or_kv_page_held_at_end"] = idle_check(
            metrics, stats, result["end_state"]
        )
        checks["clients_finished"] = check(stuck == 0, stuck, 0)
        # RSS: per server run, warm baseline against that run's last sample.
        segments, growth_checks = rss_checks(baselines, ends, args.max_rss_growth)
        checks.update(growth_checks)
        result["rss"] = {
            "segments": segments,
            "max_total_mib": max((s["total_mib"] for s in sampler.samples), default=None),
            "samples": pick_samples(sampler.samples),
            "num_samples": len(sampler.samples),
        }
        # Clean stop: SIGTERM, drain, exit 0.
        stop_code = await sup.stop(args.stop_grace_s)
        checks["clean_stop_exit_0"] = check(stop_code == 0, stop_code, 0)
        result["counts"] = tally(t.records, kill_window)
        checks.update(traffic_checks(t.records, result["counts"], kill_window))
        survivors = [r["run"] for r in sup.runs if r.get("survivors_killed")]
        checks["no_process_outlived_its_server"] = check(not survivors, survivors, [])
        result["kill"] = kill
        result["traffic_s"] = round(traffic_end - result["traffic_started_s"], 3)
        result |= traffic_summary(
            t.records, t.sessions, result["traffic_started_s"], traffic_end, result["traffic_s"]
        )
    finally:
        for task in [*clients, *warm_tasks, sampler_task, progress_task]:
            if task is not None:
                task.cancel()
        if not sup.stopping or (sup.proc and sup.proc.returncode is None):
            await sup.stop(args.stop_grace_s)
        sup_task.cancel()
        await asyncio.gather(sup_task, *clients, *warm_tasks, return_exceptions=True)
        sup.kill_survivors()
    result["server_runs"] = sup.runs
    result["checks"] = checks
    result["passed"] = all(c["pass"] for c in checks.values())
    return result
