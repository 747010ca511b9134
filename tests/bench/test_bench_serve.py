"""`bench serve` end to end against the fake server: counts, lengths, fields, failures, the CLI."""

from __future__ import annotations

import json

from inferengine.bench.config import DatasetConfig, ServeConfig, WorkloadConfig
from inferengine.bench.runner import run_serve
from inferengine.entrypoints.cli.main import main

NoneType = type(None)
# vLLM 0.26 `bench serve --save-result --save-detailed` fields and their JSON types.
VLLM_FIELDS = {
    "date": str,
    "endpoint_type": str,
    "backend": str,
    "label": (str, NoneType),
    "model_id": str,
    "tokenizer_id": str,
    "num_prompts": int,
    "request_rate": (float, int, str),
    "burstiness": float,
    "max_concurrency": (int, NoneType),
    "duration": float,
    "completed": int,
    "failed": int,
    "total_input_tokens": int,
    "total_output_tokens": int,
    "request_throughput": float,
    "request_goodput": (float, NoneType),
    "output_throughput": float,
    "total_token_throughput": float,
    "input_lens": list,
    "output_lens": list,
    "ttfts": list,
    "itls": list,
    "start_times": list,
    "generated_texts": list,
    "errors": list,
    "max_output_tokens_per_s": float,
    "max_concurrent_requests": int,
}
LATENCY_FIELDS = [
    f"{stat}_{m}_ms"
    for m in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p99")
]


def config(server, tokenizer_dir, n=16, **workload) -> ServeConfig:
    dataset = DatasetConfig(
        num_prompts=n, random_input_len=24, random_output_len=8, random_range_ratio=0.5, seed=1
    )
    return ServeConfig(
        workload=WorkloadConfig(dataset=dataset, **workload),
        base_url=server.base_url,
        tokenizer=str(tokenizer_dir),
        disable_tqdm=True,
    )


def test_all_requests_complete_at_the_asked_lengths(fake_server, tokenizer_dir):
    server = fake_server(token_delay_ms=1)
    cfg = config(server, tokenizer_dir, n=24, ignore_eos=True, max_concurrency=4, num_warmups=3)
    result = run_serve(cfg)
    assert result["completed"] == 24 and result["failed"] == 0
    assert result["output_lens"] == result["expected_output_lens"]
    assert len(set(result["output_lens"])) > 1  # lengths really vary (range ratio 0.5)
    assert result["total_output_tokens"] == sum(result["expected_output_lens"])
    # input_lens are the server's prompt_tokens (the fake counts words).
    assert result["input_lens"] == [len(b["prompt"].split()) for b in server.state.bodies[3:]]
    assert server.state.count == 27  # 3 warm-ups, not counted in the result
    assert server.state.max_active <= 4
    assert all(b["max_tokens"] in result["expected_output_lens"] for b in server.state.bodies)
    assert {b["ignore_eos"] for b in server.state.bodies} == {True}
    assert {b["temperature"] for b in server.state.bodies} == {0.0}
    assert all(len(itl) == n for itl, n in zip(result["itls"], result["output_lens"], strict=True))
    assert result["output_lens_source"] == "usage"


def test_without_ignore_eos_the_server_decides(fake_server, tokenizer_dir):
    server = fake_server(eos_after=3)
    result = run_serve(config(server, tokenizer_dir, n=8))
    assert result["output_lens"] == [min(3, n) for n in result["expected_output_lens"]]
    assert "ignore_eos" not in server.state.bodies[0]


def test_failed_requests_are_counted_and_the_run_goes_on(fake_server, tokenizer_dir):
    server = fake_server(fail_every=4, drop_every=7)
    result = run_serve(config(server, tokenizer_dir, n=20, ignore_eos=True, max_concurrency=1))
    failed = [i for i, e in enumerate(result["errors"]) if e]
    # Requests 4, 8, 12, 16, 20 get HTTP 500; 7 and 14 lose their connection.
    assert failed == [3, 6, 7, 11, 13, 15, 19]
    assert result["failed"] == 7 and result["completed"] == 13
    assert all("HTTP 500" in result["errors"][i] for i in (3, 7, 11, 15, 19))
    assert all(result["output_lens"][i] == 0 for i in failed)
    assert result["total_output_tokens"] == sum(
        n for i, n in enumerate(result["expected_output_lens"]) if i not in failed
    )


def test_chat_endpoint(fake_server, tokenizer_dir):
    server = fake_server(ttft_ms=20)
    cfg = config(server, tokenizer_dir, n=4, ignore_eos=True, endpoint="/v1/chat/completions")
    result = run_serve(cfg)
    assert result["backend"] == result["endpoint_type"] == "openai-chat"
    assert result["completed"] == 4
    assert max(result["ttfts"]) < 0.015  # the role chunk counts as the first token, as in vLLM
    assert "messages" in server.state.bodies[0]


def test_cli_saves_vllm_fields_with_their_types(fake_server, tokenizer_dir, tmp_path, capsys):
    # No --model and no --tokenizer: the model comes from /v1/models, whose root is the
    # tokenizer folder (as vLLM reports the model path).
    server = fake_server(root=str(tokenizer_dir))
    code = main(
        ["bench", "serve", "--base-url", server.base_url, "--num-prompts", "6",
         "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos",
         "--max-concurrency", "2", "--save-result", "--result-dir", str(tmp_path),
         "--label", "fake", "--metadata", "gpu=none", "run=1", "--disable-tqdm"]
    )  # fmt: skip
    assert code == 0
    files = list(tmp_path.glob("fake-infqps-concurrency2-fake-model-*.json"))
    assert len(files) == 1
    result = json.loads(files[0].read_text())
    for name, kind in VLLM_FIELDS.items():
        assert isinstance(result[name], kind), name
    for name in LATENCY_FIELDS:
        assert isinstance(result[name], float), name
    assert result["request_rate"] == "inf"
    assert (result["model_id"], result["tokenizer_id"]) == ("fake-model", str(tokenizer_dir))
    assert (result["gpu"], result["run"]) == ("none", "1")
    assert result["num_prompts"] == result["completed"] == 6
    assert all(isinstance(x, float) for itl in result["itls"] for x in itl)
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Saved the result" in out


def test_cli_percentile_choices(fake_server, tokenizer_dir, tmp_path):
    server = fake_server()
    code = main(
        ["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(tokenizer_dir),
         "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "3",
         "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9",
         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
         "--disable-tqdm"]
    )  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert {"p50_ttft_ms", "p99.9_ttft_ms", "p50_e2el_ms", "p99.9_e2el_ms"} <= result.keys()
    assert "mean_itl_ms" not in result and "p99_ttft_ms" not in result


def test_cli_explains_a_missing_tokenizer(fake_server, capsys):
    server = fake_server()  # root "fake-model" is no folder here
    assert main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "2"]) == 1
    assert "--tokenizer" in capsys.readouterr().err
