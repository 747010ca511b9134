"""Every figure the README and docs quote by hand is checked against the result folder it came
from. The tables that benchmarks/readme_performance.py generates are checked by
tests/bench/test_readme_performance.py; the rest are the quotes below: each is the docs' own
words with a format field where each figure stands, the folder (or folders) under
benchmarks/results/ it came from, and where in the folder's summary JSON each figure is. A quote
fails when the page no longer says it, or when the folder's value, formatted as the page
formats it, is not what the page says.

A figure no quote covers cannot slip in: in every section of a page that names a result folder,
each number with a unit (tok/s, TB/s, GB/s, TFLOP/s, ms, µs, s, GB, MB, %, nats, an x ratio),
each decimal number and each number in a table's cells must lie inside a quote, and on every
page so must each throughput, bandwidth, latency in ms or µs and x ratio. A quote without a
folder names a number that is not measured (a setting from the code, a target)."""

from __future__ import annotations

import itertools
import json
import re
import statistics
import string
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

Getter = Callable[..., Any]  # get(path, src=None): the value at path in each source's JSON
Value = str | Callable[[Getter], Any]


@dataclass(frozen=True)
class Quote:
    page: str  # relative to the repository root
    text: str  # the page's words (any whitespace matches any whitespace), a {:fmt} per figure
    src: str | tuple[str, ...] | None  # result folder(s); see load()
    values: tuple[Value, ...]  # per field: a JSON path, or a function of get

    @property
    def id(self) -> str:
        return f"{self.page}: {self.text[:60]}"


def Q(page: str, text: str, src: str | tuple[str, ...] | None, *values: Value) -> Quote:
    return Quote(page, text, src, values)


# ---- reading the folders ----------------------------------------------------------------------


class NotHere(Exception):
    """A source this checkout cannot read (a folder kept only in git history, no git)."""


@cache
def load(src: str) -> Any:
    """A result folder's summary: `FOLDER` (its summary.json or results.json), `FOLDER/FILE`,
    `COMMIT:FOLDER[/FILE]` (a folder that left the tree, from git history) or `configs/...`."""
    if src.startswith("configs/"):
        return json.loads((ROOT / src).read_text(encoding="utf-8"))
    commit, _, rest = src.rpartition(":")
    folder, _, file = rest.partition("/")
    names = [file] if file else ["summary.json", "results.json"]
    for name in names:
        path = f"benchmarks/results/{folder}/{name}"
        if not commit:
            if (ROOT / path).is_file():
                return json.loads((ROOT / path).read_text(encoding="utf-8"))
            continue
        try:
            shown = subprocess.run(
                ["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, timeout=60
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise NotHere(f"{src}: {e}") from e
        if shown.returncode == 0:
            return json.loads(shown.stdout)
    if commit:
        raise NotHere(f"{src}: not in this checkout's git history")
    raise FileNotFoundError(f"benchmarks/results/{folder}: no {' or '.join(names)}")


def resolve(node: Any, path: str) -> list[Any]:
    """Every value at path: keys split on '/', except where a key itself holds one ('fp8/bf16
    table'); '*' takes every item. A key missing under a '*' drops that item."""
    if not path:
        return [node]
    if path.startswith("*"):
        rest = path[2:]
        items = node.values() if isinstance(node, dict) else node
        found = []
        for item in items:
            try:
                found += resolve(item, rest)
            except (KeyError, IndexError, TypeError):
                continue
        return found
    if isinstance(node, list):
        head, _, rest = path.partition("/")
        return resolve(node[int(head)], rest)
    for key in sorted(node, key=len, reverse=True):
        if path == key or path.startswith(key + "/"):
            return resolve(node[key], path[len(key) + 1 :])
    raise KeyError(path)


AGGREGATES = {"median": statistics.median, "min": min, "max": max}


def getter(default: str | tuple[str, ...] | None) -> Getter:
    def get(path: str, src: str | tuple[str, ...] | None = None) -> Any:
        source = src or default
        path, _, aggregate = path.partition("|")
        sources = (source,) if isinstance(source, str) else source
        found = [v for s in sources for v in resolve(load(s), path)]
        if aggregate:
            return AGGREGATES[aggregate](found)
        if isinstance(source, str) and "*" not in path:
            return found[0]
        return found

    return get


def figures(quote: Quote) -> list[Any]:
    get = getter(quote.src)
    out: list[Any] = []
    for value in quote.values:
        got = get(value) if isinstance(value, str) else value(get)
        out += got if isinstance(got, list) else [got]
    return out


# ---- helpers for the quotes -------------------------------------------------------------------


def spread(path: str) -> Callable[[Getter], list[float]]:
    """The median over the folders, then the range: '62.0 ms (61.5-70.2)'."""
    return lambda get: [get(path + "|median"), get(path + "|min"), get(path + "|max")]


def every(values: list[float], fmt: str) -> float | str:
    """The one value every round rounds to ('in every round'), else a mismatch."""
    shown = {format(v, fmt) for v in values}
    return values[0] if len(shown) == 1 else f"<differs by round: {sorted(shown)}>"


def ratios(a: str, b: str) -> Callable[[Getter], list[float]]:
    """a / b in each folder, in folder order."""
    return lambda get: [x / y for x, y in zip(get(a), get(b), strict=True)]


def per_round_ratios(get: Getter) -> list[float]:
    """Messages' over chat's later-turn median TTFT, round by round (agent-apis-cpu)."""
    by_round: dict[int, dict[str, float]] = {}
    for run in get("runs"):
        by_round.setdefault(run["repeat"], {})[run["api"]] = run["result"]["later_median_ttft_ms"]
    return [r["messages"] / r["chat"] for r in by_round.values()]


def row(rows: list[dict], **match: Any) -> dict:
    (found,) = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return found


def pool_tokens(get: Getter) -> int:
    """The agent runs' GPU pool: --num-gpu-blocks-override pages of the default 16 tokens."""
    command = get("runs/0/command")
    return int(re.search(r"--num-gpu-blocks-override (\d+)", command).group(1)) * 16


def pool_share(get: Getter) -> float:
    """The active sessions at their final length, over the GPU pool."""
    return get("working_set/active_sessions_tokens") / pool_tokens(get)


def final_length(get: Getter) -> float:
    """A session's mean final length, to the hundred ('about 9,300 tokens')."""
    return round(get("working_set/mean_final_tokens_per_session"), -2)


def percent_range(path: str) -> Callable[[Getter], list[float]]:
    """The least in percent, the largest as a fraction: '96.6-97.5%'."""
    return lambda get: [100 * get(path + "|min"), get(path + "|max")]


def prefill(get: Getter, src: str, batch: int, chunk: int) -> float:
    """Our prefill TFLOP/s of a prompt without context, in one kernels-attention folder."""
    return row(get("prefill", src), batch=batch, chunk=chunk)["ours_TFLOPs"]


def prefill_2k(get: Getter) -> list[float]:
    """1 x 2k and 4 x 2k: TFLOP/s, share of the matmul rate (that rate after the first), SDPA."""
    out = []
    for batch in (1, 4):
        r = row(get("prefill"), batch=batch, chunk=2048)
        out += [r["ours_TFLOPs"], r["ours_fraction_of_matmul"]]
        out += [get("reference/matmul_TFLOPs")] if batch == 1 else []
        out.append(r["sdpa_TFLOPs"])
    return out


def over_floor(get: Getter) -> float:
    """Batch-1 median TPOT over the bandwidth floor, as the performance page's floor line."""
    tpot = get("workloads/batch1/systems/inferengine/runs/*/metrics/median_tpot_ms|median")
    return tpot / get("workloads/batch1/floor/floor_ms|median")


def attention_gains(get: Getter) -> list[float]:
    """Prefill without context, after the change over before it, all but the smallest shape:
    the least gain in percent, the largest as a fraction ('2-13%')."""
    gains = [
        a["ours_TFLOPs"] / prefill(get, ATTENTION_BEFORE, a["batch"], a["chunk"]) - 1
        for a in get("prefill", ATTENTION)
        if (a["batch"], a["chunk"]) != (1, 256)
    ]
    return [100 * min(gains), max(gains)]


def fp8_profile(get: Getter) -> list[Any]:
    """The batch-1 profile: the projections of each dtype (qkv, o and down, gate/up), their GB
    (from the FP8 groups' labels, bf16 twice that) and rate; the LM head, attention and the
    norms, rotary and activation, the same in both."""

    def groups(run: str) -> list[dict]:
        return get(f"runs/{run}/kernel_groups")

    def ms(run: str, kernel: str, **match: Any) -> float:
        return (
            sum(
                g["us_per_step"]
                for g in groups(run)
                if g["kernel"] == kernel and all(g.get(k) == v for k, v in match.items())
            )
            / 1e3
        )

    def projections(run: str) -> list[dict]:
        return [
            g
            for g in groups(run)
            if g["kernel"] == "skinny_gemm_kernel" and g["launches_per_step"] > 1
        ]

    layers = row(groups("fp8"), grid="[576, 1, 1]")["launches_per_step"]
    mb = sum(
        float(x)
        for g in projections("fp8")
        for x in re.search(r"W8A16, ([\d.+ ]+) MB", g["is"]).group(1).split("+")
    )
    gb = {"fp8": mb * layers / 1e3, "bf16": 2 * mb * layers / 1e3}
    proj = {run: sum(g["us_per_step"] for g in projections(run)) / 1e3 for run in gb}
    fp8 = {g["grid"]: g["us_per_step"] / 1e3 for g in projections("fp8")}
    rest = {
        run: sum(
            ms(run, k) for k in ("rms_norm_kernel", "rotary_store_kv_kernel", "silu_and_mul_kernel")
        )
        for run in gb
    }
    return [
        proj["fp8"], gb["fp8"], gb["fp8"] / proj["fp8"],
        fp8["[2368, 1, 1]"], fp8["[896, 1, 1]"], fp8["[576, 1, 1]"],  # gate/up, o and down, qkv
        proj["bf16"], gb["bf16"], gb["bf16"] / proj["bf16"],
        every([ms(r, "skinny_gemm_kernel", launches_per_step=1.0) for r in gb], ".2f"),
        every([ms(r, "paged_attention_kernel") for r in gb], ".2f"),
        every(list(rest.values()), ".2f"),
    ]  # fmt: skip


def byte_times(get: Getter) -> list[Any]:
    """The weights' bytes at the H100's 3.35 TB/s, what each step spends beyond them, their
    ratio, and the overhead under which an FP8 step would be 0.6x the bf16 one."""
    weights = {
        "fp8": get("workloads/batch1/floor/bytes/weights", FP8_PAIRED[-1]),
        "bf16": get("workloads/batch1/floor/bytes/weights", BF16_PAIRED[-1]),
    }
    ms = {k: v / 3.35e12 * 1e3 for k, v in weights.items()}
    step = {k: get(f"summary/{k} table/median_ms", STEP_AB) for k in ms}
    return [
        ms["fp8"], ms["bf16"],
        every([step[k] - ms[k] for k in ms], ".1f"),
        weights["fp8"] / weights["bf16"],
        (0.6 * ms["bf16"] - ms["fp8"]) / 0.4,
    ]  # fmt: skip


def router_config(name: str) -> Callable[[Getter], Any]:
    def value(_: Getter) -> Any:
        from inferengine.dp.router import RouterConfig

        return getattr(RouterConfig, name)

    return value


# ---- the folders ------------------------------------------------------------------------------

CPU_STEP = "20261127T115835Z-cpu-decode-step"
LLAMA_SERVER = "20261127T115659Z-cpu-paired-llama"
SHAPES = "20261123T212251Z-model-shapes"
CUDA_ANSWERS = "20261123T213010Z-default-model-cuda"
TP2 = "20261124T224340Z-tp2-paired-r0"
ALL_REDUCE = "20261124T223759Z-all-reduce-latency"
TP1_DECODE = "20261124T014837Z-tp-decode-qwen2.5-7b-tp1"
ROUTER = ("20261124T231207Z-router-r0", "20261124T231430Z-router-r1")
AGENT = ("20261124T185522Z-agent-r0", "20261124T190312Z-agent-r1", "20261124T191355Z-agent-r2")
AGENT_SHORT = "20261124T192504Z-agent-short-r0"
FP8_VS_BF16 = (
    "20261125T031158Z-fp8-vs-bf16-r3",
    "20261125T052518Z-fp8-vs-bf16-r4",
    "20261125T052518Z-fp8-vs-bf16-r5",
)
FP8_PAIRED = (
    "20261125T031519Z-fp8-paired-r3",
    "20261125T032130Z-fp8-paired-r4",
    "20261125T033653Z-fp8-paired-r5",
)
BF16_PAIRED = (
    "20261124T110856Z-paired-r0",
    "20261124T111613Z-paired-r1",
    "20261124T113101Z-paired-r2",
)
STEP_AB = "20261127T133403Z-decode-step-variants"
SKINNY_M1 = "20261127T132350Z-skinny-gemm"
SKINNY_M2 = "20261127T134456Z-skinny-gemm"
SKINNY_M32 = "20261125T031132Z-skinny-gemm"
ACCURACY = {
    "smollm2": "20261125T012659Z-fp8-accuracy-smollm2-gguf",
    "gemma3": "20261125T013501Z-fp8-accuracy-gemma3-270m-gguf",
    "qwen": "20261125T004910Z-fp8-accuracy-qwen2.5-7b-dummy",
    "qwen-grid": "20261125T005420Z-fp8-accuracy-qwen2.5-7b-grid",
}
INT4_ACCURACY = "20261207T155030Z-int4-accuracy-cpu"
AGENT_APIS = "20261207T164103Z-agent-apis-cpu-quiet"
NEAR_TIES = "20261124T181125Z-spec-near-ties"
SPEC_SMOLLM2 = "20261124T173326Z-spec-smollm2-k12"
PROFILE = {
    "nopdl": "20261122T105330Z-decode-profile-batch1-nopdl",
    "pdl": "20261122T105302Z-decode-profile-batch1-pdl",
    "batch1": "20261122T110141Z-decode-profile-batch1",
    "batch16": "20261122T114916Z-decode-profile-batch16-nopdl",
    "fp8": "20261125T025600Z-decode-profile-fp8-batch1-nopdl",
}
ATTENTION = "20261123T000750Z-kernels-attention"
ATTENTION_BEFORE = "20261123T000716Z-kernels-attention-before"
ATTENTION_EARLIER = "20261122T234556Z-kernels-attention"
EQUIVALENCE = (
    "20261122T142656Z-gpu-equivalence-bf16-extra",
    "20261122T143247Z-gpu-equivalence-float32-extra",
)
FIRST_BURST = (
    "20261122T145200Z-first-burst-pdl/results-pdl0.json",
    "20261122T145200Z-first-burst-pdl/results-pdl1.json",
)
W1_FIRST_HOST = "d644b0a:20261122T112133Z-w1-paired/comparison.json"
MOE_EARLY = ("fb056f8:20261124T202429Z-moe-paired-r0", "fb056f8:20261124T203144Z-moe-paired-r1")
OFFLINE_CPU = "20261122T101226Z-offline-cpu"
API_OVERHEAD = "20261122T091810Z-api-overhead"
RUN_BATCH = "20261122T092130Z-run-batch"
C256_EARLY = "20261122T112828Z-c256-paired/comparison.json"
GPU_TESTS = {
    "c6fd98b": "20261124T230030Z-gpu-tests-c6fd98b",
    "9a67f0a": "20261125T051546Z-gpu-tests-9a67f0a",
    "573829c": "20261127T121317Z-gpu-tests-573829c",
}
QWEN = "configs/qwen2.5-7b/config.json"

CPU, MODELS, PARALLEL = "docs/cpu.md", "docs/models.md", "docs/parallelism.md"
SESSIONS, QUANT, SPEC = "docs/sessions.md", "docs/quantization.md", "docs/speculative-decoding.md"
PERF, NOTES = "docs/performance.md", "docs/performance-notes.md"

TPOT = "workloads/batch1/systems/{}/runs/0/metrics/median_tpot_ms"
C256 = "workloads/c256/systems/{}/runs/0/metrics/output_throughput"
C64 = "workloads/c64/systems/{}/runs/0/metrics/{}"
TP2_W1 = "workloads/w1/systems/{}/runs/0/metrics/{}"
AGENT_IE, AGENT_VLLM = "spread/inferengine/{}/median", "spread/vllm/{}/median"
CPU_CONFIGS = ("default", "default-bf16", "dense-bf16", "dense-float32")
SHAPES_4 = ("qkv", "o", "gate-up", "down")
BACKEND_PAIRS = ("triton_vs_torch", "flex-eager_vs_torch")


def shape_row(name: str, key: str) -> Quote:
    m = f"models/{key}"
    return Q(MODELS, f"| {name} | {{:.1f}} s | {{:,.0f}} | {{:.2f}} ms | {{:.2f}} |", SHAPES,
             f"{m}/ready_s", f"{m}/w1/output_throughput", f"{m}/w1/median_itl_ms",
             f"{m}/batch1/median_tpot_ms")  # fmt: skip


def llama_row(streams: int) -> Quote:
    s = f"summary/{streams} streams"
    cell = "{:.1f} ({:.1f}-{:.1f})"
    return Q(CPU, f"| {streams} | {cell} | {cell} | {{:.2f}} |", LLAMA_SERVER,
             *(f"{s}/{system}/{k}" for system in ("inferengine", "llama-server")
               for k in ("median", "min", "max")), f"{s}/ratio")  # fmt: skip


def router_row(metric: str, cell: str, path: str, ratio: bool = True) -> Quote:
    """Cache-aware vs round-robin in each round, then the ratios by round."""
    ca, rr = (f"spread/{policy}/{path}/median" for policy in ("cache-aware", "round-robin"))

    def pairs(get: Getter) -> list[float]:
        return [v for pair in zip(get(ca), get(rr), strict=True) for v in pair]

    last = "{:.2f}, {:.2f}" if ratio else ""
    return Q(PARALLEL, f"| {metric} | {cell} | {cell} | {last} |", ROUTER, pairs,
             *([f"ratios/{path}"] if ratio else []))  # fmt: skip


def agent_row(
    metric: str, path: str, ours: str, vllm: str, ratio: str, unit: str = "", headline: bool = False
) -> Quote:
    """Median (range) over the three rounds for each system, then the median of the rounds'
    ratios; a headline row's ratio is bold and has its range too."""
    u = f" {unit}" if unit else ""
    ours_cell, vllm_cell = (f"{f}{u} ({f}-{f})" for f in (ours, vllm))
    last = f"**{ratio}** ({ratio}-{ratio})" if headline else ratio
    ratios_of_rounds = spread(f"ratios/{path}") if headline else f"ratios/{path}|median"
    return Q(SESSIONS, f"| {metric} | {ours_cell} | {vllm_cell} | {last} |", AGENT,
             spread(AGENT_IE.format(path)), spread(AGENT_VLLM.format(path)),
             ratios_of_rounds)  # fmt: skip


def accuracy_row(model: str, name: str) -> Quote:
    both = "{:.3f} (decode {:.3f})"
    return Q(QUANT, f"| {name} | {{:,}} | {both} | {both} | {{:.3f}} | {{:.3f}} |", ACCURACY[model],
             "fp8/all/positions", "fp8/all/argmax_agreement", "fp8/decode/argmax_agreement",
             "fp8/all/mean_kl", "fp8/decode/mean_kl",
             "fp8-grid/all/argmax_agreement", "float32/all/argmax_agreement")  # fmt: skip


# ---- the quotes -------------------------------------------------------------------------------

# fmt: off
QUOTES: list[Quote] = [
    # docs/cpu.md: the decode step and llama-server
    Q(CPU, "one stream {:.1f} ms through the kernels in float32, {:.1f} ms in bfloat16, {:.1f} ms "
           "dense bfloat16 and {:.1f} ms dense float32", CPU_STEP,
      *(f"step_ms_median/{c}/1" for c in CPU_CONFIGS)),
    Q(CPU, "sixteen streams {:.1f}, {:.1f}, {:.1f} and {:.1f} ms.", CPU_STEP,
      *(f"step_ms_median/{c}/16" for c in CPU_CONFIGS)),
    llama_row(1),
    llama_row(16),
    Q(CPU, "At one stream our median TPOT is {:.1f}-{:.1f} ms against {:.1f}-{:.1f} ms, our TTFT "
           "{:.0f}-{:.0f} against {:.0f}-{:.0f} ms.", LLAMA_SERVER,
      *(f"rounds/*/{s}/runs/1/{m}|{a}" for m in ("median_tpot_ms", "median_ttft_ms")
        for s in ("inferengine", "llama-server") for a in ("min", "max"))),

    # docs/models.md: model shapes on one H100, the default model's bf16 answers
    shape_row("SmolLM2-135M", "smollm2-135m"),
    shape_row("Llama-3.2-1B", "llama-3.2-1b"),
    shape_row("Llama-3.1-8B", "llama-3.1-8b"),
    shape_row("Qwen2.5-7B", "qwen2.5-7b"),
    shape_row("Qwen3-8B", "qwen3-8b"),
    shape_row("Mistral-7B-v0.1 (4k window, `--max-model-len 8192`)", "mistral-7b-v0.1"),
    Q(MODELS, "top two logprobs were within {:.2f}", CUDA_ANSWERS,
      "runs/1/comparison/*/reference_margin_at_diff|max"),

    # docs/parallelism.md: the router's settings (from the code), TP=2, all-reduce, the router
    Q(PARALLEL, "A replica {} requests and {}x above the least loaded one", None,
      router_config("balance_abs"), router_config("balance_ratio")),
    Q(PARALLEL, "Batch 1's floor (one rank reading its {:.1f} GB) is {:.1f} ms a token.", TP2,
      lambda get: get("workloads/batch1/floor/bytes/weights") / 1e9,
      "workloads/batch1/floor/floor_ms"),
    Q(PARALLEL, "{:.1f} µs against NCCL's {:.1f} µs at 8 KiB, {:.1f} against {:.1f} µs at 1 "
                "MiB, {:.1f} against {:.1f} µs at 2 MiB; NCCL wins from 4 MiB ({:.1f} against "
                "{:.1f} µs)", ALL_REDUCE,
      *(f"sizes/{size}/{k}_graph_us" for size in ("8 KiB", "1 MiB", "2 MiB", "4 MiB")
        for k in ("custom", "nccl"))),
    Q(PARALLEL, "takes {:.2f} ms at batch 1 and {:.2f} ms at batch 16", TP1_DECODE,
      "batches/1/decode_step_ms", "batches/16/decode_step_ms"),
    Q(PARALLEL, "{} sessions ({} at once) of a {:,}-token prefix ({:,} shared) growing over {} "
                "turns to about {:,.0f} tokens", ROUTER[0],
      "workload/sessions", "workload/max_active_sessions", "workload/prefix_len",
      "workload/shared_prefix_len", "workload/turns", final_length),
    router_row("output tok/s", "{:,.0f} vs {:,.0f}", "output_throughput"),
    router_row("later turns, median TTFT", "{:.1f} vs {:.1f} ms", "later_median_ttft_ms"),
    router_row("later turns, p99 TTFT", "{:.0f} vs {:.0f} ms", "later_p99_ttft_ms"),
    router_row("turn 1, median TTFT", "{:.1f} vs {:.1f} ms", "turn1_median_ttft_ms"),
    router_row("prompt tokens cached", "{:.1%} vs {:.1%}", "hit_rate", ratio=False),

    # docs/sessions.md: the CPU tier on agent sessions
    Q(SESSIONS, "with the same {:,}-page GPU pool. {} sessions × {} turns, at most {} at once, "
                "each starting from a {:,}-token prefix ({:,} shared) and growing by a {}-token "
                "reply and a {}-{}-token tool output per turn after an exponential think time of "
                "mean {:.0f} s, to about {:,.0f} tokens; {} active sessions at that length hold "
                "{:.1f}x the pool.", AGENT[0],
      lambda get: pool_tokens(get) // 16,
      *(f"workload/{k}" for k in ("sessions", "turns", "max_active_sessions", "prefix_len",
                                  "shared_prefix_len", "output_len", "tool_len_min",
                                  "tool_len_max", "think_time_s")),
      final_length, "workload/max_active_sessions", pool_share),
    agent_row("later turns, median TTFT", "later_median_ttft_ms", "{:.1f}", "{:,.0f}", "{:.3f}",
              "ms", headline=True),
    agent_row("later turns, p99 TTFT", "later_p99_ttft_ms", "{:.0f}", "{:,.0f}", "{:.3f}", "ms"),
    agent_row("turn 1, median TTFT", "turn1_median_ttft_ms", "{:.0f}", "{:.0f}", "{:.2f}", "ms"),
    agent_row("output tok/s", "output_throughput", "{:.0f}", "{:.0f}", "{:.2f}", headline=True),
    Q(SESSIONS, "| prompt tokens cached | {:.0%} (GPU {:.0%}, CPU {:.0%}) | {:.0%} | |", AGENT,
      *(AGENT_IE.format(k) + "|median" for k in ("hit_rate", "gpu_hit_rate", "cpu_hit_rate")),
      AGENT_VLLM.format("hit_rate") + "|median"),
    Q(SESSIONS, "vLLM finds {:.0%} of prompt tokens cached", AGENT,
      AGENT_VLLM.format("hit_rate") + "|median"),
    Q(SESSIONS, "({:,}-token prefixes growing to about {:,.0f} tokens, {} at once, {:.1f}x the "
                "pool", AGENT_SHORT,
      "workload/prefix_len", final_length, "workload/max_active_sessions", pool_share),
    Q(SESSIONS, "vLLM still finds {:.0%} cached and the gain is smaller: later-turn median TTFT "
                "{:.1f} against {:.1f} ms ({:.2f}), p99 {:.0f} against {:.0f} ms ({:.2f}), output "
                "{:.0f} against {:.0f} tok/s ({:.2f}).", AGENT_SHORT,
      AGENT_VLLM.format("hit_rate"),
      *(p for k in ("later_median_ttft_ms", "later_p99_ttft_ms", "output_throughput")
        for p in (AGENT_IE.format(k), AGENT_VLLM.format(k), f"ratios/{k}"))),

    # docs/quantization.md: FP8 against our bf16, the floor, the kernels, accuracy
    Q(QUANT, "batch-1 median TPOT {:.2f} ms against {:.2f} ms in every round, {:.2f}x; "
             "concurrency 256 {:.2f}x, {:.2f}x, {:.2f}x by round.", FP8_VS_BF16,
      lambda get: every(get(TPOT.format("inferengine")), ".2f"),
      lambda get: every(get(TPOT.format("bf16")), ".2f"),
      lambda get: every(ratios(TPOT.format("inferengine"), TPOT.format("bf16"))(get), ".2f"),
      ratios(C256.format("inferengine"), C256.format("bf16"))),
    Q(QUANT, "The FP8 step is {:.2f}x its bandwidth floor ({:.2f} ms: {:.2f} GB, the bf16 LM head "
             "{:.2f} GB of it), bf16 {:.2f}x its own", FP8_PAIRED,
      over_floor, "workloads/batch1/floor/floor_ms|median",
      lambda get: get("workloads/batch1/floor/bytes/total", FP8_PAIRED[-1]) / 1e9,
      lambda get: get("vocab_size", QWEN) * get("hidden_size", QWEN) * 2 / 1e9,
      lambda get: over_floor(lambda path: get(path, BF16_PAIRED))),
    Q(QUANT, "FP8 {:.3f} ms against bf16 {:.3f} ms, {:.3f}x.", STEP_AB,
      "summary/fp8 table/median_ms", "summary/bf16 table/median_ms", "summary/fp8/bf16 table"),
    Q(QUANT, "reads FP8 weights at {:.2f} (qkv), {:.2f} (o), {:.2f} (gate/up) and {:.2f} TB/s "
             "(down)", SKINNY_M1, *(f"sweep/qwen-{s} m=1/best/ours_TBps" for s in SHAPES_4)),
    Q(QUANT, "at every M up to {} on all four shapes", SKINNY_M32,
      lambda get: max(m for m in get("m") if all(
          r["ours_us"] < r["cublas_us"] for r in get("rows") if r["m"] <= m))),
    accuracy_row("smollm2", "SmolLM2-135M-Instruct (real, GGUF, CPU emulating the CUDA paths)"),
    accuracy_row("gemma3", "Gemma-3-270M (real, GGUF Q4_K_M, CPU emulating the CUDA paths)"),
    Q(QUANT, "| Qwen2.5-7B shape (dummy, H100) | {:,} | {:.3f} | {:.3f} | {:.3f} | {:.3f} |",
      ACCURACY["qwen"], "fp8/all/positions", "fp8/all/argmax_agreement", "fp8/all/mean_kl",
      lambda get: get("fp8-grid/all/argmax_agreement", ACCURACY["qwen-grid"]),
      "float32/all/argmax_agreement"),
    Q(QUANT, "int8 (GPTQ layout, groups of 64) agrees with the float model on {:.1%} of "
             "positions, mean KL {:.4f} nats; int4 (AWQ layout, groups of 64, since its 576 hidden "
             "features take no groups of 128) on {:.1%}, mean KL {:.2f} nats, and with groups of "
             "32 on {:.1%}, mean KL {:.2f} nats", INT4_ACCURACY,
      "schemes/gptq:64:8/argmax_agreement", "schemes/gptq:64:8/mean_kl",
      "schemes/awq:64/argmax_agreement", "schemes/awq:64/mean_kl",
      "schemes/awq:32/argmax_agreement", "schemes/awq:32/mean_kl"),
    Q(QUANT, "short of the bar of {:.0%} agreement and a mean KL of {:.2f} nats", None,
      lambda get: 0.95, lambda get: 0.02),
    Q(QUANT, "(even float32 against bf16 agrees on {:.0%}); on real weights the greedy "
             "continuations agree on {:.1f}-{:.1%} and the random-token prompt positions (diffuse "
             "by construction) on {:.0f}-{:.0%}.", (ACCURACY["smollm2"], ACCURACY["gemma3"]),
      lambda get: get("float32/all/argmax_agreement", ACCURACY["qwen"]),
      percent_range("fp8/decode/argmax_agreement"),
      percent_range("fp8/prefill/argmax_agreement")),

    # docs/responses-and-messages.md: the same agent sessions through Messages and chat
    Q("docs/responses-and-messages.md",
      "({:.3f}-{:.3f} in every round, equal for both APIs), and the later turns' median TTFT "
      "through Messages was {:.2f}x that through chat (per round {:.2f}-{:.2f})", AGENT_APIS,
      "runs/*/result/later_client_hit_rate|min", "runs/*/result/later_client_hit_rate|max",
      "ratios/later_median_ttft_ms",
      lambda get: min(per_round_ratios(get)), lambda get: max(per_round_ratios(get))),

    # docs/speculative-decoding.md
    Q(SPEC, "{} of the {} requests part, each where the plain model's top two tokens lie within "
            "{:.2f} nats in bf16 (float32 picks the speculating run's token {} times, plain's {};",
      NEAR_TIES, lambda get: get("requests") - get("identical"), "requests",
      "widest_model_dtype_gap", "float32_picks/spec", "float32_picks/plain"),
    Q(SPEC, "its GPU is busy {:.0f}-{:.0f}% of the judge's window", SPEC_SMOLLM2,
      "workloads/grounded/systems/inferengine/spread/busy_pct/min",
      "workloads/grounded/systems/inferengine/spread/busy_pct/max"),
    # A goal, not a measurement.
    Q(SPEC, "A 2x batch-1 speed-up on grounded prompts on every host", None),

    # docs/performance.md, by hand under the generated tables
    Q(PERF, "measured {:.2f}x at c256 with the same flags, vLLM's GPU busy {:.0f}% of the "
            "benchmark.", C256_EARLY,
      "metrics/output_throughput/ratio", "runs/vllm/gpu/mean_util_pct/benchmark"),
    Q(PERF, "W1's throughput is {:.2f}x vLLM's (median ITL equal, TTFT {:.2f}x", TP2,
      *(lambda get, m=m: get(TP2_W1.format("inferengine", m)) / get(TP2_W1.format("vllm", m))
        for m in ("output_throughput", "median_ttft_ms"))),

    # docs/performance-notes.md: decode, attention kernels, first bursts
    Q(NOTES, "a batch-1 step goes from {:.2f} to {:.2f} ms", (PROFILE["nopdl"], PROFILE["pdl"]),
      "pipelined_step_ms"),
    Q(NOTES, "{:.2f} ms at the current revision", PROFILE["batch1"], "pipelined_step_ms"),
    Q(NOTES, "A batch-16 step takes {:.2f} ms pipelined and {:.2f} ms of kernels: {:.0%} matmuls, "
             "{:.0%} attention, {:.0%} the rest; the host's {:.2f} ms of scheduling per step",
      PROFILE["batch16"], "pipelined_step_ms", "gpu_kernel_ms_per_step", "gpu_share/matmul",
      "gpu_share/attention", "gpu_share/other",
      lambda get: get("median_phase_ms/schedule_ms") + get("median_phase_ms/update_ms")),
    Q(NOTES, "decode reads the KV cache at {:.0%} of the measured copy rate at batch 64 x 4k",
      ATTENTION,
      lambda get: row(get("decode"), batch=64, context=4096)["ours_fraction_of_copy"]),
    Q(NOTES, "reaches {:.0f} TFLOP/s at 1 x 2k tokens ({:.0%} of the {:.0f} TFLOP/s bf16 matmul "
             "rate of that run; SDPA {:.0f}) and {:.0f} at 4 x 2k ({:.0%}; SDPA {:.0f}).",
      ATTENTION, prefill_2k),
    Q(NOTES, "A 2k chunk after 6k of context runs at {:.0f} (batch 1) and {:.0f} (batch 4) "
             "TFLOP/s, where SDPA with the equivalent mask gets {:.0f} and {:.0f}.", ATTENTION,
      lambda get: [row(get("prefill_context"), batch=b, chunk=2048, context=6144)[k]
                   for k in ("ours_TFLOPs", "sdpa_TFLOPs") for b in (1, 4)]),
    Q(NOTES, "sped up prompts without any by {:.0f}-{:.0%} (1 x 2k from {:.0f}, 32 x 256 from "
             "{:.0f} to {:.0f} TFLOP/s), all but the smallest (1 x 256: {:.0f} to {:.0f})",
      ATTENTION, attention_gains,
      lambda get: prefill(get, ATTENTION_BEFORE, 1, 2048),
      lambda get: [prefill(get, s, b, c) for b, c in ((32, 256), (1, 256))
                   for s in (ATTENTION_BEFORE, ATTENTION)]),
    Q(NOTES, "1 x 2k varied from {:.0f} to {:.0f} TFLOP/s between runs", ATTENTION,
      lambda get: [prefill(get, s, 1, 2048) for s in (ATTENTION_EARLIER, ATTENTION_BEFORE)]),
    Q(NOTES, "Short chunks in large batches still trail SDPA (16 x 512: {:.0f} against {:.0f}).",
      ATTENTION,
      lambda get: [row(get("prefill"), batch=16, chunk=512)[k]
                   for k in ("ours_TFLOPs", "sdpa_TFLOPs")]),
    Q(NOTES, "W1 {:,.0f} tok/s, median ITL {:.2f} ms, median TTFT {:.0f} ms, p99 TTFT {:.0f} ms; "
             "batch 1 {:.2f} ms per token", SHAPES,
      *(f"models/qwen2.5-7b/w1/{k}"
        for k in ("output_throughput", "median_itl_ms", "median_ttft_ms", "p99_ttft_ms")),
      "models/qwen2.5-7b/batch1/median_tpot_ms"),
    Q(NOTES, "a top-two logprob margin of at most {:.2f}); in float32 all three give identical "
             "tokens for {} of {} requests", EQUIVALENCE,
      lambda get: max(v for k in BACKEND_PAIRS
                      for v in get(f"{k}/divergences/*/reference_top2_logprob_margin",
                                   EQUIVALENCE[0])),
      lambda get: min(get(f"{k}/requests_identical", EQUIVALENCE[1]) for k in BACKEND_PAIRS),
      lambda get: get("triton_vs_torch/requests", EQUIVALENCE[1])),
    Q(NOTES, "spends {:.0f}-{:.0f} ms of host time launching", FIRST_BURST,
      "bursts/*/launch_ms/0|min", "bursts/*/launch_ms/0|max"),
    Q(NOTES, "the first burst's p99 TTFT was {:.0f} ms", W1_FIRST_HOST,
      "metrics/p99_ttft_ms/values/inferengine"),

    # docs/performance-notes.md: the CPU server and run-batch
    Q(NOTES, "offline generation {:.0f} output tok/s against Transformers' batched `generate` "
             "{:.0f} and one prompt at a time {:.1f}", OFFLINE_CPU,
      *(f"{k}/output_tokens_per_s"
        for k in ("inferengine", "transformers_batched", "transformers_one_at_a_time"))),
    Q(NOTES, "the server streams at {:.2f}x `LLM.generate`", API_OVERHEAD, "ratio"),
    Q(NOTES, "run-batch at {:.2f}x", RUN_BATCH, "ratio_run_batch_vs_generate"),

    # docs/performance-notes.md: FP8 weights
    Q(NOTES, "the FP8 projections take {:.2f} ms for {:.2f} GB ({:.2f} TB/s; gate/up {:.2f}, o "
             "and down {:.2f}, qkv {:.2f}), the bf16 ones {:.2f} ms for {:.2f} GB ({:.2f} TB/s); "
             "the LM head ({:.2f} ms), attention ({:.2f} ms) and the norms, rotary and activation "
             "({:.2f} ms) cost both the same.", PROFILE["fp8"], fp8_profile),
    Q(NOTES, "(an {:.0f} us qkv launch spends a larger share ramping up and draining than bf16's "
             "{:.0f} us one)", PROFILE["fp8"],
      *(lambda get, run=run: row(get(f"runs/{run}/kernel_groups"),
                                 grid="[576, 1, 1]")["us_per_launch"]
        for run in ("fp8", "bf16"))),
    Q(NOTES, "At one row: {:.2f}, {:.2f}, {:.2f} and {:.2f} TB/s for qkv, o, gate/up and down",
      SKINNY_M1, *(f"sweep/qwen-{s} m=1/best/ours_TBps" for s in SHAPES_4)),
    Q(NOTES, "at two rows qkv, o and down {:.2f}, {:.2f} and {:.2f} TB/s", SKINNY_M2,
      lambda get: [row(get("rows"), name=f"qwen-{s}", m=2)["ours_TBps"]
                   for s in ("qkv", "o", "down")]),
    Q(NOTES, "FP8 {:.3f} ms against bf16 {:.3f} ms, {:.3f}x; before the read-ahead {:.3f} against "
             "{:.3f} ms ({:.3f}x).", STEP_AB,
      *(f"summary/{k}" for k in ("fp8 table/median_ms", "bf16 table/median_ms", "fp8/bf16 table",
                                 "fp8 before/median_ms", "bf16 before/median_ms",
                                 "fp8/bf16 before"))),
    Q(NOTES, "take at 3.35 TB/s ({:.2f} and {:.2f} ms), each step spends about {:.1f} ms in both "
             "dtypes (launch ramps and tails, attention, norms): with the bytes' ratio at {:.2f}, "
             "a 0.6x step needs that below about {:.1f} ms.", None, byte_times),

    # docs/performance-notes.md: bugs, from folders kept in git history
    Q(NOTES, "had c64 at {:.2f}x and {:.2f}x vLLM's", MOE_EARLY,
      ratios(C64.format("inferengine", "output_throughput"),
             C64.format("vllm", "output_throughput"))),
    Q(NOTES, "with p99 TTFT {:.1f}-{:.1f}x", MOE_EARLY,
      lambda get: sorted(ratios(C64.format("inferengine", "p99_ttft_ms"),
                                C64.format("vllm", "p99_ttft_ms"))(get))),

    # docs/performance-notes.md: GPU test runs
    Q(NOTES, "{} passed and {} skipped by their own parametrisation", GPU_TESTS["c6fd98b"],
      "final_counts/passed", "final_counts/skipped"),
    Q(NOTES, "(FP8 and norm tests, every engine case, {})", GPU_TESTS["9a67f0a"], "total/passed"),
    Q(NOTES, "(the engine file's {} cases, on an H200)", GPU_TESTS["573829c"], "total/passed"),
]
# fmt: on


# ---- finding a quote on its page --------------------------------------------------------------


def fields(text: str) -> list[tuple[str, str | None]]:
    """(literal text, format spec or None at the end) pieces of a quote."""
    return [
        (lit, spec if name is not None else None)
        for lit, name, spec, _ in string.Formatter().parse(text)
    ]


def literal(text: str) -> str:
    """A regex for text in which any run of whitespace matches any run of whitespace."""
    return r"\s+".join(re.escape(part) for part in re.split(r"\s+", text))


def pattern(quote: Quote, shown: list[str] | None) -> str:
    """The quote as a regex: each figure as shown (or, with None, any number) in a group."""
    out, i = [], 0
    for lit, spec in fields(quote.text):
        out.append(literal(lit))
        if spec is not None:
            out.append(f"({re.escape(shown[i])})" if shown else r"([-\d.,]+%?)")
            i += 1
    return "".join(out)


def rendered(quote: Quote) -> list[str] | None:
    """Each figure as the page should show it, or None when a source is not in this checkout."""
    try:
        values = figures(quote)
    except NotHere:
        return None
    specs = [spec for _, spec in fields(quote.text) if spec is not None]
    assert len(values) == len(specs), f"{quote.id}: {len(specs)} fields, {len(values)} values"
    return [
        format(v, s) if not isinstance(v, str) else v for v, s in zip(values, specs, strict=True)
    ]


@cache
def page_text(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


@pytest.mark.parametrize("quote", QUOTES, ids=[q.id for q in QUOTES])
def test_quoted_figure_matches_its_folder(quote):
    text = page_text(quote.page)
    shown = rendered(quote)
    if shown is None:
        pytest.skip(f"{quote.src}: not readable in this checkout")
    if re.search(pattern(quote, shown), text):
        return
    found = re.search(pattern(quote, None), text)
    if found is None:
        raise AssertionError(f"{quote.page} no longer says: {quote.text!r} (reword it here too)")
    said = list(found.groups())
    raise AssertionError(
        f"{quote.page}: {quote.text!r}\n  the page says {said}\n  the folder says {shown}"
    )


def test_quotes_are_distinct_and_their_folders_exist():
    assert len({(q.page, q.text) for q in QUOTES}) == len(QUOTES)
    for q in QUOTES:
        sources = (q.src,) if isinstance(q.src, str) else q.src or ()
        for s in sources:
            if ":" in s or s.startswith("configs/"):
                continue
            assert (RESULTS / s.split("/")[0]).is_dir(), f"{q.id}: no folder {s}"


# ---- no figure outside a quote ----------------------------------------------------------------

FOLDER = re.compile(r"\d{8}T\d{6}Z-[\w.-]*\w")
GENERATED = re.compile(r"<!-- ([\w ]+): generated by[^>]*-->.*?<!-- \1: end -->", re.S)
MASKED = [
    GENERATED,
    re.compile(r"^```.*?^```", re.S | re.M),  # code blocks
    re.compile(r"<!--.*?-->", re.S),
    re.compile(r"`[^`\n]*`"),  # code spans
    re.compile(r"\]\([^)]*\)"),  # link targets
    re.compile(r"\d+GB\s+HBM3"),  # a GPU's name
]
NUMBER = re.compile(r"(?<![\w.,/])(?<![A-Za-z]-)\d+(?:,\d{3})*(?:\.\d+)*")
UNIT = re.compile(r"(?:\s?(?:tok/s|TB/s|GB/s|TFLOP/s|ms|µs|us|s|GB|MB|%|nats)|[x×])(?![\w/])")
EVERYWHERE = ("tok/s", "TB/s", "GB/s", "TFLOP/s", "ms", "µs", "us", "x", "×")


def blank(text: str, span: tuple[int, int]) -> str:
    a, b = span
    return text[:a] + re.sub(r"[^\n]", " ", text[a:b]) + text[b:]


def sections(text: str) -> list[tuple[int, int]]:
    """(start, end) of each part between headings, outside code blocks."""
    starts, fence, pos = [0], False, 0
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            starts.append(pos)
        pos += len(line)
    return list(zip(starts, [*starts[1:], len(text)], strict=True))


def candidates(page: str) -> list[tuple[int, str]]:
    """(offset, number) of every figure the rules above want covered."""
    raw = page_text(page)
    text = raw
    for regex in MASKED:
        for m in regex.finditer(raw):
            text = blank(text, m.span())
    found = []
    for start, end in sections(raw):
        cites = bool(FOLDER.search(GENERATED.sub("", raw[start:end])))
        body = text[start:end]
        cells = table_cells(body)
        numbers = list(NUMBER.finditer(body))
        wanted: set[int] = set()
        for i, m in enumerate(numbers):
            if m.group().count(".") > 1:
                continue  # a version
            unit = UNIT.match(body, m.end())
            anywhere = unit is not None and unit.group().strip() in EVERYWHERE
            in_cell = any(a <= m.start() < b for a, b in cells)
            if anywhere or (cites and (unit or "." in m.group() or in_cell)):
                wanted.add(i)
        for i in sorted(wanted, reverse=True):  # the first number of a range: '61.5-70.2 ms'
            before = numbers[i - 1] if i else None
            if before and body[before.end() : numbers[i].start()] in ("-", "–"):
                wanted.add(i - 1)
        found += [(start + numbers[i].start(), numbers[i].group()) for i in sorted(wanted)]
    return found


def table_cells(body: str) -> list[tuple[int, int]]:
    """Spans of a table's cells after its first column, header rows left out."""
    spans, pos = [], 0
    lines = body.splitlines(keepends=True)
    for k, line in enumerate(lines):
        is_row = line.lstrip().startswith("|")
        header = k + 1 < len(lines) and re.match(r"\s*\|\s*:?-{3}", lines[k + 1])
        separator = re.match(r"\s*\|\s*:?-{3}", line)
        if is_row and not header and not separator:
            bars = [pos + m.start() for m in re.finditer(r"\|", line)]
            spans += list(itertools.pairwise(bars[1:]))
        pos += len(line)
    return spans


def covered(page: str) -> list[tuple[int, int]]:
    spans = []
    for quote in (q for q in QUOTES if q.page == page):
        shown = rendered(quote)
        spans += [m.span() for m in re.finditer(pattern(quote, shown), page_text(page))]
    return spans


PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")),
]


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_is_quoted(page):
    spans = covered(page)
    text = page_text(page)
    loose = [
        f"line {text.count(chr(10), 0, at) + 1}: {number!r} in "
        f"{text[max(0, at - 40) : at + 30].replace(chr(10), ' ')!r}"
        for at, number in candidates(page)
        if not any(a <= at < b for a, b in spans)
    ]
    assert not loose, (
        f"{page} quotes figures that no quote in {Path(__file__).name} checks against a result "
        "folder; add a quote (or drop the figure):\n  " + "\n  ".join(loose)
    )


def test_the_scan_finds_figures():
    """The rules catch what they should, so an empty scan means no loose figure, not no scan."""
    assert candidates(CPU)  # quoted figures are found, then covered
    assert not [n for _, n in candidates("docs/index.md")]
