"""Command-line flags of the benchmarks (vLLM's names where vLLM has the flag) and their configs."""

from __future__ import annotations

import argparse
import json
import math

from inferengine.bench.config import (
    DATASET_NAMES,
    ENDPOINT_BACKENDS,
    PERCENTILE_METRICS,
    DatasetConfig,
    ServeConfig,
    WorkloadConfig,
)
from inferengine.errors import ConfigError


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Flags that define the workload; `bench paired` sends it unchanged to every system."""
    d = DatasetConfig()
    g = parser.add_argument_group("workload")
    g.add_argument("--endpoint", default="/v1/completions", choices=list(ENDPOINT_BACKENDS))
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument(
        "--tokenizer",
        help="tokenizer folder or name used to build prompts (default: --model if it is a folder)",
    )
    g.add_argument(
        "--dataset-name",
        default="random",
        choices=[*DATASET_NAMES, "prefix_repetition"],
    )
    g.add_argument(
        "--dataset-path",
        help='ShareGPT-style JSON (sharegpt), or JSONL of {"prompt": ...} lines sent as they are '
        "(custom)",
    )
    g.add_argument("--custom-output-len", type=int, default=d.custom_output_len)
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--random-input-len", type=int, default=d.random_input_len)
    g.add_argument("--random-output-len", type=int, default=d.random_output_len)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=d.random_range_ratio,
        help="r: lengths uniform over the integers in [L(1-r), L(1+r)]",
    )
    g.add_argument("--random-prefix-len", type=int, default=d.random_prefix_len)
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument(
        "--prefix-repetition-prefix-len", type=int, default=d.prefix_repetition_prefix_len
    )
    g.add_argument(
        "--prefix-repetition-suffix-len", type=int, default=d.prefix_repetition_suffix_len
    )
    g.add_argument(
        "--prefix-repetition-num-prefixes", type=int, default=d.prefix_repetition_num_prefixes
    )
    g.add_argument(
        "--prefix-repetition-output-len", type=int, default=d.prefix_repetition_output_len
    )
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s; inf sends all at once, otherwise gamma-distributed gaps",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 is Poisson, <1 burstier, >1 more regular",
    )
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    g.add_argument(
        "--temperature",
        type=_temperature,
        default=0.0,
        help="sampling temperature sent with each request; 'none' leaves it to the server",
    )
    g.add_argument("--num-warmups", type=int, default=0, help="uncounted requests sent first")
    g.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    g.add_argument(
        "--extra-body", type=json.loads, default=None, help="JSON merged into every request"
    )
    g.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="SLOs for request_goodput, e.g. ttft:200 tpot:20 e2el:2000",
    )
    g.add_argument(
        "--percentile-metrics",
        default=",".join(PERCENTILE_METRICS),
        help="comma-separated subset of ttft,tpot,itl,e2el",
    )
    g.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    g.add_argument("--disable-tqdm", action="store_true")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    add_workload_args(parser)
    g = parser.add_argument_group("result")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="vLLM's flag, for the same command lines: our result always holds the per-request "
        "arrays (output lengths, times)",
    )
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--label", default=None)
    g.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", default=[])


def _temperature(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ConfigError(f"--goodput {item!r}: write ttft:MS, tpot:MS or e2el:MS")
        slos[key] = float(value)
    return slos


def _metadata(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--metadata {item!r}: write KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = set(metrics) - set(PERCENTILE_METRICS)
    if unknown:
        raise ConfigError(
            f"--percentile-metrics: unknown {sorted(unknown)}; use ttft,tpot,itl,e2el"
        )
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be at least 1")
    dataset = DatasetConfig(
        name=args.dataset_name.replace("_", "-"),
        path=args.dataset_path,
        num_prompts=args.num_prompts,
        seed=args.seed,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        sharegpt_output_len=args.sharegpt_output_len,
        prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
        prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
        prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_repetition_output_len=args.prefix_repetition_output_len,
        custom_output_len=args.custom_output_len,
    )
    return WorkloadConfig(
        dataset=dataset,
        endpoint=args.endpoint,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        num_warmups=args.num_warmups,
        request_timeout_s=args.request_timeout if args.request_timeout > 0 else None,
        extra_body=args.extra_body or {},
        goodput=_goodput(args.goodput),
        percentile_metrics=metrics,
        metric_percentiles=tuple(float(p) for p in args.metric_percentiles.split(",")),
    )


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        workload=workload_from_args(args),
        base_url=args.base_url.rstrip("/"),
        model=args.model,
        tokenizer=args.tokenizer,
        label=args.label,
        metadata=_metadata(args.metadata),
        disable_tqdm=args.disable_tqdm,
        save_result=args.save_result,
        result_dir=args.result_dir,
        result_filename=args.result_filename,
    )
