"""`inferengine bench serve | paired | agent | plot`: the parsers and their handlers."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from inferengine.bench.args import add_serve_args, add_workload_args, workload_from_args
from inferengine.bench.config import PERCENTILE_METRICS
from inferengine.bench.gates import __doc__ as GATES_DOC
from inferengine.bench.systems import __doc__ as SYSTEMS_DOC
from inferengine.bench.vllm_client import __doc__ as VLLM_CLIENT_DOC
from inferengine.bench.workloads import WORKLOADS
from inferengine.errors import ConfigError

WORKLOADS_TEXT = "\n".join(f"  {w.name:<14}{w.description}" for w in WORKLOADS.values())
PAIRED_EPILOG = f"""\
systems (--system, repeated; the first two give the ratios):
{SYSTEMS_DOC.split(chr(10), 2)[2]}
gates (--gate, repeated; exit status 1 if one fails, after everything is written):
{GATES_DOC.split(chr(10), 2)[2]}
workloads (--workload, repeated; without it the workload flags describe one, "custom"):
{WORKLOADS_TEXT}
the judge (--judge auto: vLLM's client when --vllm-pythonpath holds vllm, else ours):
{VLLM_CLIENT_DOC.split(chr(10), 2)[2]}
example:
  inferengine bench paired --model-dir configs/qwen2.5-7b --served-model-name qwen2.5-7b \\
    --system "inferengine=preset:inferengine --load-format dummy --max-model-len 2048" \\
    --system "vllm=preset:vllm --load-format dummy --dtype bfloat16 --max-model-len 2048" \\
    --workload w1 --workload batch1 --repeats 3 --gate "w1:output_throughput>=1.05"
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="serving benchmarks against HTTP servers")
    sub = bench.add_subparsers(
        dest="bench_command", metavar="{serve,paired,agent,plot}", required=True
    )

    serve = sub.add_parser(
        "serve",
        help="benchmark one OpenAI-compatible server (vLLM's `bench serve` result format)",
        description="Stream a workload to one OpenAI-compatible server and report TTFT, TPOT, "
        "ITL, E2E latency and throughput under the field names of `vllm bench serve`.",
    )
    add_serve_args(serve)
    serve.set_defaults(func=serve_handler)

    paired = sub.add_parser(
        "paired",
        help="the same workloads against several servers, repeated in alternating order",
        description="Launch each --system in turn (the order rotating every round), run each "
        "workload through the judge with the same warm-up, trace the GPU, and write a result "
        "folder with every run, medians and ranges, ratios and gates.",
        epilog=PAIRED_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_paired_args(paired)
    paired.set_defaults(func=paired_handler)

    agent = sub.add_parser(
        "agent",
        help="multi-turn agent sessions with think time: TTFT of later turns, KV hits by tier",
        description="N sessions x T turns, each turn resending the conversation plus a tool "
        "output, against one server (--url) or several launched in alternating rounds "
        "(--system); writes a result folder with TTFT of turn 1 and of turns >= 2, "
        "throughput and the KV cache's hit rates by tier.",
        epilog=AGENT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_agent_args(agent)
    agent.set_defaults(func=agent_handler)

    plot = sub.add_parser("plot", help="PNG charts of a result folder")
    plot.add_argument("result_dir", type=Path, metavar="RESULT_DIR")
    plot.set_defaults(func=plot_handler)


AGENT_EPILOG = f"""\
systems (--system, repeated; the first two give the ratios):
{SYSTEMS_DOC.split(chr(10), 2)[2]}
gates (--gate, repeated; exit status 1 if one fails): as `bench paired`, over the metrics of
summary.json's `spread`, e.g. later_median_ttft_ms, output_throughput, gpu_hit_rate
example:
  inferengine bench agent --model-dir configs/qwen2.5-7b --served-model-name qwen2.5-7b \\
    --system "inferengine=preset:inferengine --load-format dummy --kv-offloading-size 16" \\
    --system "vllm=preset:vllm --load-format dummy --dtype bfloat16" \\
    --sessions 48 --turns 8 --gate "later_median_ttft_ms<=0.333"
"""


def add_agent_args(parser: argparse.ArgumentParser) -> None:
    from inferengine.bench.agent import THINK_DISTRIBUTIONS, AgentWorkload
    from inferengine.bench.agent_apis import APIS

    d = AgentWorkload()
    g = parser.add_argument_group("systems")
    where = g.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="one server that is already running, e.g. http://host:8000")
    where.add_argument("--system", action="append", metavar="SPEC", help="as `bench paired`")
    g.add_argument("--label", default="server", help="the name of the --url system")
    g.add_argument("--model-dir", help="model folder for presets; the default --tokenizer")
    g.add_argument("--served-model-name", help="name presets serve the model under")
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--tokenizer", help="whose vocabulary prompts are drawn from (token ids)")
    g.add_argument(
        "--api",
        action="append",
        choices=APIS,
        help="the API the turns go through (default completions: token ids); repeated, each "
        "system runs once per API per round, as SYSTEM-API (e.g. --api messages --api chat: "
        "ratios messages/chat)",
    )
    g.add_argument("--health-timeout", type=float, default=900.0, help="seconds to wait")
    g.add_argument("--stop-timeout", type=float, default=30.0, help="SIGTERM→SIGKILL seconds")
    w = parser.add_argument_group("sessions (the same for every system)")
    w.add_argument("--sessions", type=int, default=d.sessions, help="N sessions")
    w.add_argument("--turns", type=int, default=d.turns, help="T turns per session")
    w.add_argument("--prefix-len", type=int, default=d.prefix_len, help="turn 1's prompt")
    w.add_argument(
        "--shared-prefix-len",
        type=int,
        default=d.shared_prefix_len,
        help="leading prefix tokens that every session shares (a system prompt)",
    )
    w.add_argument(
        "--tool-len",
        default=f"{d.tool_len_min}:{d.tool_len_max}",
        metavar="MIN:MAX",
        help="tokens a turn adds as tool output, uniform over [MIN, MAX]",
    )
    w.add_argument("--output-len", type=int, default=d.output_len, help="tokens per reply")
    w.add_argument("--think-time", type=float, default=d.think_time_s, help="mean seconds")
    w.add_argument(
        "--think-distribution", choices=THINK_DISTRIBUTIONS, default=d.think_distribution
    )
    w.add_argument("--think-sigma", type=float, default=d.think_sigma, help="lognormal sigma")
    w.add_argument(
        "--session-gap", type=float, default=d.session_gap_s, help="mean s between starts"
    )
    w.add_argument(
        "--max-active-sessions", type=int, default=d.max_active_sessions, help="C at once"
    )
    w.add_argument("--seed", type=int, default=d.seed, help="round k uses seed + k")
    w.add_argument("--num-warmups", type=int, default=d.num_warmups)
    w.add_argument(
        "--prompt-cache-retention",
        default=d.prompt_cache_retention,
        help='sent with prompt_cache_key = the session id ("in_memory", "1h", ...)',
    )
    w.add_argument(
        "--no-cache-fields",
        action="store_true",
        help="send neither prompt_cache_key nor prompt_cache_retention",
    )
    w.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    r = parser.add_argument_group("runs and result folder")
    r.add_argument("--repeats", type=int, default=1, help="rounds over all systems")
    r.add_argument("--start-repeat", type=int, default=0, help="number of the first round")
    r.add_argument("--revision", help="the code revision measured (default: git here)")
    r.add_argument("--out-dir", type=Path, help="default benchmarks/results/<UTC stamp>-<name>")
    r.add_argument("--name", default="agent", help="the folder's name after the stamp")
    r.add_argument("--gate", action="append", default=[], metavar="EXPR")


def agent_workload_from_args(args: argparse.Namespace):
    from inferengine.bench.agent import AgentWorkload

    low, sep, high = args.tool_len.partition(":")
    try:
        tool_min, tool_max = int(low), int(high if sep else low)
    except ValueError:
        raise ConfigError(f"--tool-len {args.tool_len!r}: write MIN:MAX, e.g. 200:400") from None
    return AgentWorkload(
        sessions=args.sessions,
        turns=args.turns,
        prefix_len=args.prefix_len,
        shared_prefix_len=args.shared_prefix_len,
        tool_len_min=tool_min,
        tool_len_max=tool_max,
        output_len=args.output_len,
        think_time_s=args.think_time,
        think_distribution=args.think_distribution,
        think_sigma=args.think_sigma,
        session_gap_s=args.session_gap,
        max_active_sessions=args.max_active_sessions,
        seed=args.seed,
        num_warmups=args.num_warmups,
        prompt_cache_retention=args.prompt_cache_retention,
        cache_fields=not args.no_cache_fields,
        request_timeout_s=args.request_timeout,
    )


def agent_handler(args: argparse.Namespace) -> int:
    from inferengine.bench.agent_paired import AgentBenchConfig, run_agent_bench
    from inferengine.bench.systems import SystemSpec, parse_system

    tokenizer = args.tokenizer or args.model_dir
    if not tokenizer:
        raise ConfigError("bench agent draws token ids from a vocabulary: pass --tokenizer")
    served = args.served_model_name or Path(args.model_dir or "model").name
    if args.url:
        systems = [SystemSpec(args.label, base_url=args.url.rstrip("/"))]
    else:
        systems = [parse_system(s, args.model_dir, served) for s in args.system]
    systems, api_of = per_api(systems, args.api or ["completions"])
    cfg = AgentBenchConfig(
        workload=agent_workload_from_args(args),
        systems=systems,
        **_run_fields(args, tokenizer),
        command_line=shlex.join(["inferengine", *sys.argv[1:]]),
        revision=args.revision,
        api_of=api_of,
    )
    return run_agent_bench(cfg)


def per_api(systems: list, apis: list[str]) -> tuple[list, dict[str, str]]:
    """Each system once per API (named SYSTEM-API when there are several), and their APIs."""
    if len(set(apis)) != len(apis):
        raise ConfigError("give each --api once")
    if len(apis) == 1:
        return systems, {s.name: apis[0] for s in systems}
    out = [dataclasses.replace(s, name=f"{s.name}-{api}") for s in systems for api in apis]
    return out, {s.name: api for s, api in zip(out, apis * len(systems), strict=True)}


def add_paired_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("systems")
    g.add_argument(
        "--system",
        action="append",
        required=True,
        metavar="SPEC",
        help="NAME=COMMAND, NAME=url:URL, NAME=preset:PRESET [ARGS] or PRESET (see below)",
    )
    g.add_argument("--model-dir", help="model folder for presets; the default --tokenizer")
    g.add_argument("--served-model-name", help="name presets serve the model under")
    g.add_argument("--health-timeout", type=float, default=900.0, help="seconds to wait")
    g.add_argument("--stop-timeout", type=float, default=30.0, help="SIGTERM→SIGKILL seconds")
    g.add_argument("--vllm-python", default="python3")
    g.add_argument("--vllm-pythonpath", default="/tmp/vllm-site")
    w = parser.add_argument_group("runs")
    w.add_argument(
        "--workload",
        action="append",
        default=[],
        metavar="NAME",
        help=f"a named workload: {', '.join(WORKLOADS)} (repeatable)",
    )
    w.add_argument("--repeats", type=int, default=3, help="rounds over all systems")
    w.add_argument(
        "--start-repeat",
        type=int,
        default=0,
        help="number of the first round (a later call continues the alternating order)",
    )
    w.add_argument("--judge", choices=["auto", "vllm", "ours"], default="auto")
    w.add_argument(
        "--our-client", action="store_true", help="also run our client after vLLM's judge"
    )
    w.add_argument(
        "--alone",
        action="append",
        default=[],
        metavar="NAME",
        help="also run system NAME alone, as a user would (NAME-alone in the rotation; e.g. "
        "vllm: `vllm serve`, then `vllm bench serve`), for its figure beside the harness's",
    )
    w.add_argument(
        "--launch-warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="48 short requests through the judge after each /health, before the workloads",
    )
    w.add_argument(
        "--gpu-trace",
        action="store_true",
        help="sample the GPU through NVML beside the judge (busy_pct); it shares the host's "
        "CPUs with the systems, so its figures are marked traced: use it in a separate run",
    )
    w.add_argument("--revision", help="the code revision measured (default: git here)")
    add_workload_args(parser)
    r = parser.add_argument_group("result folder")
    r.add_argument("--out-dir", type=Path, help="default benchmarks/results/<UTC stamp>-<name>")
    r.add_argument("--name", default="paired", help="the folder's name after the stamp")
    r.add_argument("--gate", action="append", default=[], metavar="EXPR")
    r.add_argument("--gpu-interval", type=float, default=0.2, help="--gpu-trace's period (s)")


def serve_handler(args: argparse.Namespace) -> int:
    from inferengine.bench.args import serve_config_from_args
    from inferengine.bench.runner import run_serve

    result = run_serve(serve_config_from_args(args))
    return 0 if result["completed"] > 0 else 1


def paired_handler(args: argparse.Namespace) -> int:
    from inferengine.bench.paired import PairedConfig, run_paired, vllm_available
    from inferengine.bench.systems import parse_system

    tokenizer = args.tokenizer or args.model_dir
    if not tokenizer:
        raise ConfigError("bench paired builds one prompt set for all systems: pass --tokenizer")
    served = args.served_model_name or Path(args.model_dir or "model").name
    judge = args.judge
    if judge == "auto":
        judge = "vllm" if vllm_available(args.vllm_pythonpath) else "ours"
        if judge == "ours":
            print(f"vLLM is not in {args.vllm_pythonpath}: our client is the judge")
    cfg = PairedConfig(
        systems=[parse_system(s, args.model_dir, served) for s in args.system],
        workloads=paired_workloads(args),
        **_run_fields(args, tokenizer),
        judge=judge,
        our_client=args.our_client,
        alone=args.alone,
        launch_warmup=args.launch_warmup,
        gpu_trace=args.gpu_trace,
        gpu_interval_s=args.gpu_interval,
        vllm_python=args.vllm_python,
        vllm_pythonpath=args.vllm_pythonpath,
        disable_tqdm=args.disable_tqdm,
        command_line=shlex.join(["inferengine", *sys.argv[1:]]),
        revision=args.revision,
    )
    return run_paired(cfg)


def paired_workloads(args: argparse.Namespace) -> list:
    """The named workloads, or the one the workload flags describe; never both."""
    from inferengine.bench.workloads import NamedWorkload, named_workload

    workload = workload_from_args(args)
    if args.workload:
        parser = argparse.ArgumentParser()
        add_workload_args(parser)
        if workload != workload_from_args(parser.parse_args([])):
            raise ConfigError(
                "--workload fixes every workload flag; drop the flags (--num-prompts, "
                "--random-input-len, ...) or drop --workload and describe one custom workload"
            )
        return [named_workload(name) for name in args.workload]
    # The summary reads the median and p99 of every latency metric.
    workload = dataclasses.replace(
        workload,
        percentile_metrics=PERCENTILE_METRICS,
        metric_percentiles=tuple(sorted({*workload.metric_percentiles, 99.0})),
    )
    return [NamedWorkload("custom", "the workload flags of this run", workload)]


def plot_handler(args: argparse.Namespace) -> int:
    from inferengine.bench.plot import plot_results

    for path in plot_results(args.result_dir):
        print(f"wrote {path}")
    return 0


def _run_fields(args: argparse.Namespace, tokenizer: str) -> dict:
    """The settings every paired run shares: model, output, gates, rounds, server timeouts."""
    from inferengine.bench.gates import parse_gate

    return dict(
        tokenizer=tokenizer,
        model=args.model,
        model_dir=args.model_dir,
        out_dir=args.out_dir,
        name=args.name,
        gates=[parse_gate(g) for g in args.gate],
        repeats=args.repeats,
        start_repeat=args.start_repeat,
        health_timeout_s=args.health_timeout,
        stop_timeout_s=args.stop_timeout,
    )
