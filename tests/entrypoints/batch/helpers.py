"""Helpers for the batch tests: rows over every setting, expected results, JSONL files, runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inferengine import LLM, SamplingParams
from inferengine.entrypoints.batch import BatchConfig, BatchSummary, run_batch

MAX_MODEL_LEN = 128
PROMPTS = ["Hello world", "The quick brown fox", "Paris is the capital of", "how are you today?"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is Paris?"},
    ],
]
# Greedy, seeded sampling, and seeded sampling with top-k and a stop string.
SETTINGS = [
    {"temperature": 0.0, "max_tokens": 8},
    {"temperature": 0.9, "top_p": 0.9, "seed": 7, "max_tokens": 8},
    {"temperature": 1.0, "top_k": 20, "seed": 123, "max_tokens": 6, "stop": ["o"]},
]


def run(llm: LLM, input_path: Path, output_path: Path, **config: Any) -> BatchSummary:
    config.setdefault("quiet", True)
    return run_batch(llm.llm_engine, BatchConfig(str(input_path), str(output_path), **config))


def mixed_rows() -> list[dict[str, Any]]:
    """Completion and chat rows over every setting: {"prompt" | "messages", **setting}."""
    rows = []
    for i, settings in enumerate(SETTINGS):
        rows.append({"prompt": PROMPTS[i % len(PROMPTS)], **settings})
        rows.append({"messages": CONVERSATIONS[i % len(CONVERSATIONS)], **settings})
        rows.append({"prompt": PROMPTS[(i + 1) % len(PROMPTS)], **settings})
    return rows


def expected(llm: LLM, row: dict[str, Any]) -> dict[str, Any]:
    """What `LLM.generate` / `LLM.chat` give for the row: text, finish reason, token counts."""
    settings = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
    params = SamplingParams(**settings)
    if "messages" in row:
        out = llm.chat(row["messages"], params, use_tqdm=False)[0]
    else:
        out = llm.generate(row["prompt"], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    return {
        "output_text": completion.text,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(completion.token_ids),
    }


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def openai_line(custom_id: str, row: dict[str, Any]) -> dict[str, Any]:
    url = "/v1/chat/completions" if "messages" in row else "/v1/completions"
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": row}
