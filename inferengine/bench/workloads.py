"""The named workloads of `bench paired --workload NAME`: the README's comparisons, fixed in code.

Every workload but `grounded` sends random token prompts (vLLM's `random` dataset, the same seed
for every system) and asks for exactly the output length (`ignore_eos`); `grounded` sends the
input-grounded chat prompts of benchmarks/data/grounded-smollm2.jsonl (quote, edit or
summarise a given text; SmolLM2's chat format) and lets the model stop at its end of turn. All
run at temperature 0 and warm each server up with the same requests before it is measured.
`long-prompt` needs a server started with `--max-model-len 8192` or more, `rag` 4096 (2,560
prompt + 160 output tokens at most), `prefill-only` and `batch1-8k` 8448 (8,192 prompt tokens
and their outputs); the others fit 2048. `prefill-only` asks for one token, so its throughput
is prefill alone: `mfu.py` turns it into a share of the GPU's measured bf16 matmul peak.
The `json-*` workloads sample at temperature 1.0 (greedy decoding of random weights tends to
repeat one allowed token); `json-c16`/`json-c64` send requests drawn like those of
`json-c16-plain`/`json-c64-plain`, with a JSON schema on each (vLLM's `structured_outputs` field,
which both servers read). Each of the four draws with a seed of its own: the same prompts run
again on the same server would be prefix-cache hits, flattering whichever runs second.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from inferengine.bench.config import PERCENTILE_METRICS, DatasetConfig, WorkloadConfig
from inferengine.errors import ConfigError

GROUNDED_PROMPTS = "benchmarks/data/grounded-smollm2.jsonl"  # relative to the checkout


@dataclass(frozen=True)
class NamedWorkload:
    name: str
    description: str
    workload: WorkloadConfig


def _workload(
    dataset: DatasetConfig, *, concurrency: int, warmups: int, ignore_eos: bool
) -> WorkloadConfig:
    """Temperature 0, the same warm-up for every system, the README's percentiles."""
    return WorkloadConfig(
        dataset=dataset,
        max_concurrency=concurrency,
        ignore_eos=ignore_eos,
        temperature=0.0,
        num_warmups=warmups,
        percentile_metrics=PERCENTILE_METRICS,
        metric_percentiles=(99.0,),
    )


def _random(
    description: str,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    concurrency: int,
    warmups: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> tuple[str, WorkloadConfig]:
    dataset = DatasetConfig(
        name="random",
        num_prompts=num_prompts,
        random_input_len=input_len,
        random_output_len=output_len,
        random_range_ratio=range_ratio,
        random_prefix_len=prefix_len,
    )
    return description, _workload(
        dataset, concurrency=concurrency, warmups=warmups, ignore_eos=True
    )


# A record with a bounded name and tags and an open-ended summary: the grammar holds every token
# (random weights rarely close the last string, so replies run to their length like the twins').
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "summary": {"type": "string"},
    },
    "required": ["id", "name", "tags", "summary"],
    "additionalProperties": False,
}


def _json_pair(concurrency: int, num_prompts: int) -> dict[str, tuple[str, WorkloadConfig]]:
    """W1's lengths at `concurrency`, sampled: the plain twin and the one under the schema."""
    description, plain = _random(
        f"{num_prompts} prompts, in 256 ±50%, out 64 ±50%, concurrency {concurrency}, "
        "temperature 1.0",
        input_len=256, output_len=64, range_ratio=0.5, num_prompts=num_prompts,
        concurrency=concurrency, warmups=16,
    )  # fmt: skip
    plain = replace(plain, temperature=1.0, dataset=replace(plain.dataset, seed=concurrency))
    body = {"structured_outputs": {"json": JSON_SCHEMA}}
    constrained = replace(
        plain, extra_body=body, dataset=replace(plain.dataset, seed=concurrency + 1)
    )
    return {
        f"json-c{concurrency}-plain": (description, plain),
        f"json-c{concurrency}": (f"{description}, a JSON schema on every request", constrained),
    }


_DEFINITIONS: dict[str, tuple[str, WorkloadConfig]] = {
    "w1": _random(
        "100 prompts, in 256 ±50%, out 64 ±50%, concurrency 16",
        input_len=256, output_len=64, range_ratio=0.5, num_prompts=100, concurrency=16,
        warmups=16,
    ),
    "batch1": _random(
        "8 prompts, in 256, out 128, one at a time",
        input_len=256, output_len=128, num_prompts=8, concurrency=1, warmups=2,
    ),
    "c256": _random(
        "500 prompts, in 512, out 256, concurrency 256",
        input_len=512, output_len=256, num_prompts=500, concurrency=256, warmups=32,
    ),
    "shared-prefix": _random(
        "200 prompts, a 1024-token prefix shared by all + 256 own, out 128, concurrency 32",
        input_len=256, output_len=128, prefix_len=1024, num_prompts=200, concurrency=32,
        warmups=16,
    ),
    "long-prompt": _random(
        "48 prompts, in 6144, out 128, concurrency 8 (server --max-model-len 8192)",
        input_len=6144, output_len=128, num_prompts=48, concurrency=8, warmups=4,
    ),
    "rag": _random(
        "128 prompts, in 2048 ±25%, out 128 ±25%, concurrency 32 (server --max-model-len 4096+)",
        input_len=2048, output_len=128, range_ratio=0.25, num_prompts=128, concurrency=32,
        warmups=16,
    ),
    "prefill-only": _random(
        "64 prompts, in 8192, out 1, concurrency 16 (server --max-model-len 8448)",
        input_len=8192, output_len=1, num_prompts=64, concurrency=16, warmups=16,
    ),
    "batch1-8k": _random(
        "8 prompts, in 8192, out 16, one at a time: median TTFT (server --max-model-len 8448)",
        input_len=8192, output_len=16, num_prompts=8, concurrency=1, warmups=2,
    ),
    "c128": _random(
        "384 prompts, in 512, out 256, concurrency 128",
        input_len=512, output_len=256, num_prompts=384, concurrency=128, warmups=32,
    ),
    "c64": _random(
        "320 prompts, in 512, out 256, concurrency 64",
        input_len=512, output_len=256, num_prompts=320, concurrency=64, warmups=16,
    ),
    "grounded": (
        "18 input-grounded chat prompts (quote, edit, summarise), out <= 256, one at a time",
        _workload(
            DatasetConfig(
                name="custom", path=GROUNDED_PROMPTS, num_prompts=18, custom_output_len=256
            ),
            concurrency=1, warmups=2, ignore_eos=False,
        ),
    ),
}  # fmt: skip
_DEFINITIONS |= _json_pair(16, 200) | _json_pair(64, 640)

WORKLOADS: dict[str, NamedWorkload] = {
    name: NamedWorkload(name, description, workload)
    for name, (description, workload) in _DEFINITIONS.items()
}


def named_workload(name: str) -> NamedWorkload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ConfigError(
            f"unknown workload {name!r}; named workloads are {', '.join(WORKLOADS)} "
            "(or leave out --workload and describe one with the workload flags)"
        ) from None
