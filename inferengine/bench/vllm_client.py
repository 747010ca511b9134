"""The same workload through vLLM's own client (`vllm bench serve`, 0.26), to cross-check ours.

How our workload maps onto vLLM's flags (`vllm_bench_flags` builds exactly this):

    ours                              vLLM 0.26 `bench serve`
    --endpoint /v1/completions        --backend openai        --endpoint /v1/completions
    --endpoint /v1/chat/completions   --backend openai-chat   --endpoint /v1/chat/completions
    (the system's URL)                --base-url
    (the model id our run used)       --model
    --tokenizer                       --tokenizer
    --dataset-name random             --dataset-name random (vLLM then always sends ignore_eos)
    --dataset-name sharegpt           --dataset-name sharegpt --dataset-path
    --dataset-name prefix-repetition  --dataset-name prefix_repetition
    --random-input-len/-output-len/-range-ratio/-prefix-len    the same names
    --sharegpt-output-len             --sharegpt-output-len
    --prefix-repetition-{prefix-len,suffix-len,num-prefixes,output-len}   the same names
    --dataset-name custom             --dataset-name custom --dataset-path --custom-output-len
                                      --skip-chat-template --disable-shuffle
    --num-prompts --seed --request-rate --burstiness --max-concurrency --num-warmups
                                      the same names
    --temperature T                   --temperature T (ours defaults to 0, vLLM's to unset)
    --ignore-eos                      --ignore-eos
    --extra-body JSON                 --extra-body JSON
    --goodput K:V ...                 --goodput K:V ...
    --percentile-metrics, --metric-percentiles   the same names
    (always)                          --save-result --save-detailed --disable-tqdm
                                      --result-dir --result-filename --label
                                      (the per-request arrays give the output-length digest of
                                      `spec_counters.py`; compaction drops them from the folder)

Not mapped: --request-timeout (vLLM's client waits up to 6 hours). vLLM's client also asks the
server's /tokenize to re-align random prompts when the tokenizers disagree; ours does not.
"""

from __future__ import annotations

import json
from pathlib import Path

from inferengine.bench.config import WorkloadConfig, percentile_label

VLLM_PYTHONPATH = "/tmp/vllm-site"
VLLM_DATASET_NAMES = {
    "random": "random",
    "sharegpt": "sharegpt",
    "prefix-repetition": "prefix_repetition",
    "custom": "custom",
}


def vllm_bench_flags(
    workload: WorkloadConfig, base_url: str, model: str | None, tokenizer: str | None
) -> list[str]:
    """`vllm bench serve` flags for the same workload against `base_url`."""
    w, d = workload, workload.dataset
    dataset = VLLM_DATASET_NAMES[d.name.replace("_", "-")]
    flags = ["--backend", w.backend, "--base-url", base_url, "--endpoint", w.endpoint]
    if model:
        flags += ["--model", model]
    if tokenizer:
        flags += ["--tokenizer", tokenizer]
    flags += ["--dataset-name", dataset, "--num-prompts", str(d.num_prompts), "--seed", str(d.seed)]
    if dataset == "random":
        flags += [
            "--random-input-len", str(d.random_input_len),
            "--random-output-len", str(d.random_output_len),
            "--random-range-ratio", str(d.random_range_ratio),
            "--random-prefix-len", str(d.random_prefix_len),
        ]  # fmt: skip
    elif dataset == "custom":
        flags += [
            "--dataset-path", str(d.path),
            "--custom-output-len", str(d.custom_output_len),
            "--skip-chat-template", "--disable-shuffle",
        ]  # fmt: skip
    elif dataset == "sharegpt":
        flags += ["--dataset-path", str(d.path)]
        if d.sharegpt_output_len is not None:
            flags += ["--sharegpt-output-len", str(d.sharegpt_output_len)]
    else:
        flags += [
            "--prefix-repetition-prefix-len", str(d.prefix_repetition_prefix_len),
            "--prefix-repetition-suffix-len", str(d.prefix_repetition_suffix_len),
            "--prefix-repetition-num-prefixes", str(d.prefix_repetition_num_prefixes),
            "--prefix-repetition-output-len", str(d.prefix_repetition_output_len),
        ]  # fmt: skip
    flags += ["--request-rate", str(w.request_rate), "--burstiness", str(w.burstiness)]
    if w.max_concurrency is not None:
        flags += ["--max-concurrency", str(w.max_concurrency)]
    flags += ["--num-warmups", str(w.num_warmups)]
    if w.temperature is not None:
        flags += ["--temperature", str(w.temperature)]
    if w.ignore_eos:
        flags += ["--ignore-eos"]
    if w.extra_body:
        flags += ["--extra-body", json.dumps(w.extra_body)]
    if w.goodput:
        flags += ["--goodput", *(f"{k}:{v}" for k, v in w.goodput.items())]
    flags += [
        "--percentile-metrics", ",".join(w.percentile_metrics),
        "--metric-percentiles", ",".join(percentile_label(p) for p in w.metric_percentiles),
    ]  # fmt: skip
    return flags


def vllm_bench_command(
    workload: WorkloadConfig,
    base_url: str,
    model: str | None,
    tokenizer: str | None,
    result_file: Path,
    label: str,
    python: str = "python3",
    pythonpath: str = VLLM_PYTHONPATH,
) -> list[str]:
    """The full command (argv) that runs vLLM's client and saves its summary JSON."""
    return [
        "env", f"PYTHONPATH={pythonpath}",
        python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        *vllm_bench_flags(workload, base_url, model, tokenizer),
        "--save-result", "--save-detailed", "--disable-tqdm",
        "--result-dir", str(result_file.parent), "--result-filename", result_file.name,
        "--label", label,
    ]  # fmt: skip
