"""`bench serve`: a workload against one server, with timed arrivals, a concurrency cap and a result."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from inferengine.bench.client import RequestInput, RequestOutput, send_request
from inferengine.bench.config import ServeConfig, WorkloadConfig
from inferengine.bench.datasets import SampleRequest, load_tokenizer, sample_requests
from inferengine.bench.metrics import build_metrics, format_summary
from inferengine.errors import ConfigError


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times, in seconds from the start, of `n` requests.

    Gaps are gamma distributed with shape `burstiness` and mean 1/rate (burstiness 1: Poisson
    arrivals; below 1 burstier, above 1 more regular), then rescaled so that the last request goes
    out at n / rate, as vLLM does. The draws are those of vLLM's client for the same seed. An
    infinite rate sends everything at once.
    """
    if burstiness <= 0:
        raise ConfigError("--burstiness must be positive")
    if request_rate <= 0:
        raise ConfigError("--request-rate must be positive")
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        scale = 1.0 / (request_rate * burstiness)
        gaps = np.random.RandomState(seed).gamma(shape=burstiness, scale=scale, size=n)
    times = np.cumsum(gaps)
    return times * ((n / request_rate) / times[-1])


def new_session(max_concurrency: int | None) -> aiohttp.ClientSession:
    """One keep-alive connection pool for the run; proxies from the environment are ignored."""
    limit = max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    return aiohttp.ClientSession(
        connector=connector, trust_env=False, timeout=aiohttp.ClientTimeout(total=None)
    )


async def fetch_first_model(
    session: aiohttp.ClientSession, base_url: str
) -> tuple[str, str | None]:
    """The id (and `root`, often the model's path) of the first model `/v1/models` lists."""
    url = f"{base_url}/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
            response.raise_for_status()
            models = (await response.json()).get("data") or []
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        raise ConfigError(f"could not list models at {url} ({e}); is the server up?") from e
    if not models:
        raise ConfigError(f"{url} lists no models; pass --model")
    return str(models[0]["id"]), models[0].get("root")


def resolve_tokenizer_id(tokenizer: str | None, model: str, root: str | None) -> str:
    """--tokenizer if given, else the model name or the server's model root if it is a folder here."""
    if tokenizer:
        return tokenizer
    for candidate in (model, root):
        if candidate and Path(candidate).is_dir():
            return candidate
    raise ConfigError(
        f"prompts are built with a tokenizer, and neither the model name {model!r} nor its "
        f"root {root!r} is a folder here; pass --tokenizer PATH"
    )


async def run_requests(
    session: aiohttp.ClientSession,
    inputs: Sequence[RequestInput],
    workload: WorkloadConfig,
    seed: int,
    disable_tqdm: bool = False,
) -> tuple[list[RequestOutput], float, list[float]]:
    """Send `inputs` on their arrival schedule; returns outputs, duration and send times (s)."""
    offsets = arrival_offsets(len(inputs), workload.request_rate, workload.burstiness, seed)
    limit = asyncio.Semaphore(workload.max_concurrency or len(inputs) or 1)
    pbar = tqdm(total=len(inputs), disable=disable_tqdm, file=sys.stderr)

    async def one(req: RequestInput) -> RequestOutput:
        async with limit:
            out = await send_request(session, req, workload.request_timeout_s)
        pbar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    for req, offset in zip(inputs, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    pbar.close()
    return list(outputs), duration, [o.start_time - start for o in outputs]


def request_inputs(
    requests: Sequence[SampleRequest], workload: WorkloadConfig, model: str, base_url: str
) -> list[RequestInput]:
    api_url = base_url.rstrip("/") + workload.endpoint
    return [
        RequestInput(
            prompt=r.prompt,
            prompt_len=r.prompt_len,
            output_len=r.expected_output_len,
            model=model,
            api_url=api_url,
            chat=workload.is_chat,
            ignore_eos=workload.ignore_eos,
            temperature=workload.temperature,
            extra_body=workload.extra_body or None,
        )
        for r in requests
    ]


async def benchmark(
    cfg: ServeConfig, requests: Sequence[SampleRequest] | None = None
) -> dict[str, Any]:
    """Run the benchmark and return the result dict (vLLM's fields, then ours)."""
    w = cfg.workload
    base_url = cfg.base_url.rstrip("/")
    async with new_session(w.max_concurrency) as session:
        model, root = (cfg.model, None) if cfg.model else await fetch_first_model(session, base_url)
        tokenizer_id = resolve_tokenizer_id(cfg.tokenizer, model, root)
        if requests is None:
            requests = sample_requests(w.dataset, load_tokenizer(tokenizer_id))
        inputs = request_inputs(requests, w, model, base_url)
        if w.num_warmups > 0:
            print(f"Warming up with {w.num_warmups} requests...", file=sys.stderr)
            warm = dataclasses.replace(w, request_rate=math.inf)
            await run_requests(session, [inputs[0]] * w.num_warmups, warm, 0, True)
        outputs, duration, start_times = await run_requests(
            session, inputs, w, w.dataset.seed, cfg.disable_tqdm
        )
    failed = [o.error for o in outputs if not o.success]
    for i, error in enumerate(failed[:10]):
        print(f"Error {i}: {error}", file=sys.stderr)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": w.backend,
        "backend": w.backend,
        "label": cfg.label,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": w.dataset.num_prompts,
        **cfg.metadata,
        "request_rate": w.request_rate if w.request_rate < math.inf else "inf",
        "burstiness": w.burstiness,
        "max_concurrency": w.max_concurrency,
    }
    result |= build_metrics(
        outputs,
        duration,
        w,
        expected_input_lens=[r.prompt_len for r in requests],
        expected_output_lens=[r.expected_output_len for r in requests],
        start_times=start_times,
    )
    result |= {
        "client": "inferengine bench serve",
        "base_url": base_url,
        "endpoint": w.endpoint,
        "dataset_name": w.dataset.name,
        "seed": w.dataset.seed,
        "ignore_eos": w.ignore_eos,
        "temperature": w.temperature,
        "num_warmups": w.num_warmups,
        "request_timeout_s": w.request_timeout_s,
        "extra_body": w.extra_body,
    }
    return result


def result_path(cfg: ServeConfig, result: dict) -> Path:
    """vLLM's file name, `{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`, unless given."""
    w = cfg.workload
    name = cfg.result_filename
    if not name:
        concurrency = f"-concurrency{w.max_concurrency}" if w.max_concurrency is not None else ""
        model = str(result["model_id"]).rstrip("/").split("/")[-1]
        label = cfg.label or w.backend
        name = f"{label}-{w.request_rate}qps{concurrency}-{model}-{result['date']}.json"
    return Path(cfg.result_dir or ".") / name


def jsonable(value: object) -> object:
    """Infinities as the string "inf" (as vLLM writes request_rate), so the JSON stays standard."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def save_result(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(result)), encoding="utf-8")
    return path


def run_serve(cfg: ServeConfig, requests: Sequence[SampleRequest] | None = None) -> dict[str, Any]:
    """`bench serve` from Python: run, print the summary, save the JSON if asked."""
    result = asyncio.run(benchmark(cfg, requests))
    print(format_summary(result, cfg.workload))
    if cfg.save_result:
        path = save_result(result, result_path(cfg, result))
        print(f"Saved the result to {path}")
    return result
