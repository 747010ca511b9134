"""Soak test: mixed traffic against `inferengine serve` under a supervisor, one engine kill midway.

    python benchmarks/soak.py --torch-threads 1                 # 10 minutes, default model, CPU
    python benchmarks/soak.py --duration-s 90 --torch-threads 1 --results-dir /tmp/soak  # a trial

(--torch-threads 1: on a small CPU shared with other work, two OpenMP threads spin-waiting on
each other made single requests 10 to 30 times slower in our trials.)

The server (`inferengine serve`, the default SmolLM2-135M GGUF unless --model) runs under a
supervisor loop that restarts it whenever it exits, as systemd's `Restart=always` would. A bounded
number of async clients send a mix of traffic to 127.0.0.1: streamed chat, non-streamed
completions, n > 1, JSON-schema response_format, forced tool calls, multi-turn agent sessions
(prompt_cache_key + prompt_cache_retention / cache_control), shared prefixes under
prompt_cache_key, streams the client drops part-way, and bad inputs (malformed JSON, lone
surrogates, unknown model, negative max_tokens, huge prompts and bodies) that must get a 4xx.
At --kill-at of the run the engine-core child of the API server is SIGKILLed: the server should
fail its in-flight requests and exit non-zero within --exit-within-s; the supervisor restarts it
and traffic resumes.

Timeline: the server starts (not timed); one request of each kind warms it; then --duration-s of
traffic. Each server run's RSS baseline is taken --warmup-s into its traffic, or later, once every
KV page has been written once (the CPU KV cache becomes resident as it fills), but before the kill
(first run), or for the restarted run by 2 x --warmup-s later or --min-after-restart-s before the
planned end, whichever comes later. After the kill and the restart,
another warm pass beside the resumed traffic, and at least --min-after-restart-s of traffic after
that run's baseline (the run is extended if the restart was slow).

Every request is classified: ok, rejected_4xx (a bad input refused, as it should be),
unexpected_4xx (a good input refused), cut_by_kill (failed while in flight in the kill window:
from the kill until the restarted server is healthy) or failed (5xx, connection errors and
timeouts outside that window, bad response bodies, bad inputs accepted). At the end /metrics and
/stats must show no request running or waiting and no KV page held by a request (prefix-cached
and leased free pages are free), and the server's RSS (API process + its children) must have
grown less than --max-rss-growth from a warm baseline, per server run. The script exits 1 if any
check fails and writes benchmarks/results/<UTC stamp>-soak-cpu/ (results.json: counts per class
and kind, checks, a few RSS samples; command, environment, and each server run's log tail).

This file is the command line; the run itself is benchmarks/soak_parts/ (run.py, and the
modules it names in its package docstring).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder
from soak_parts.checks import check, mark_unexpected_exits
from soak_parts.report import print_summary, write_logs
from soak_parts.run import soak

REPO = Path(__file__).resolve().parent.parent
NAME = "soak-cpu"
DEFAULT_SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "256MiB"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak's options; the block size is read from --server-arg (the server's default 16)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--model", default=None, help="model to serve (default: the server's)")
    p.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=None,
        help=f"extra `inferengine serve` argument, repeatable "
        f"(default: {' '.join(DEFAULT_SERVER_ARGS)})",
    )
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the server (default: the engine's choice); 1 avoids OpenMP "
        "spin-wait thrash on a small, busy CPU",
    )
    p.add_argument(
        "--kill-at",
        type=float,
        default=0.5,
        help="kill the engine core at this fraction of the run",
    )
    p.add_argument("--no-kill", dest="kill_at", action="store_const", const=None)
    p.add_argument(
        "--exit-within-s",
        type=float,
        default=5.0,
        help="the API server must exit this soon after the engine is killed",
    )
    p.add_argument(
        "--exit-wait-s",
        type=float,
        default=30.0,
        help="after this long, a server that has not exited is stopped",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="traffic seconds before each RSS baseline (default: min(60, run/8))",
    )
    p.add_argument(
        "--min-after-restart-s",
        type=float,
        default=30.0,
        help="traffic after the restarted server's RSS baseline (extends the run if needed)",
    )
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--rss-interval-s", type=float, default=5.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--max-requests", type=int, default=100_000, help="a bound on the count")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--restart-delay-s", type=float, default=1.0, help="systemd's RestartSec")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument(
        "--settle-s",
        type=float,
        default=15.0,
        help="at the end, how long to wait for the server to go idle",
    )
    p.add_argument("--stop-grace-s", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--no-results", action="store_true", help="print only, write no folder")
    args = p.parse_args(argv)
    if args.server_args is None:
        args.server_args = list(DEFAULT_SERVER_ARGS)
    args.block_size = 16  # the server's default; --server-arg --block-size N changes it
    for i, arg in enumerate(args.server_args):
        if arg.startswith("--block-size="):
            args.block_size = int(arg.split("=", 1)[1])
        elif arg == "--block-size" and i + 1 < len(args.server_args):
            args.block_size = int(args.server_args[i + 1])
    if args.warmup_s is None:
        args.warmup_s = min(60.0, args.duration_s / 8)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak, write the result folder, print the summary; 0 if every check passed."""
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="inferengine-soak-"))
    started = time.time()
    try:
        result = asyncio.run(soak(args, workdir))
    except RuntimeError as e:
        result = {"error": str(e), "passed": False, "checks": {}}
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("soak: interrupted; the server was stopped, no results written")
        shutil.rmtree(workdir, ignore_errors=True)
        return 130
    result["wall_s"] = round(time.time() - started, 1)
    result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if "server_runs" in result:
        mark_unexpected_exits(result)
        unexpected = [r["run"] for r in result["server_runs"] if r["unexpected_exit"]]
        result["checks"]["no_unexpected_server_exits"] = check(not unexpected, unexpected, [])
        result["passed"] = all(c["pass"] for c in result["checks"].values())
    result.get("kill", {}).pop("restart_ready_mono", None)
    folder = None
    if not args.no_results:
        folder = write_result_folder(NAME, result, root=args.results_dir)
        write_logs(folder, workdir)
    print_summary(result, folder)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0 if result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
