"""Multi-LoRA over HTTP: adapters picked by `model`, listed by /v1/models with their parent,
unknown names 404 as OpenAI answers, and adapters loaded and unloaded while others run."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from inferengine.engine.arg_utils import EngineArgs
from inferengine.entrypoints.openai.api_server import build_app
from inferengine.entrypoints.openai.config import ServerConfig
from inferengine.errors import ConfigError
from tests.conftest import hf_greedy, hf_model
from tests.lora.adapters import make_adapter, peft_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = list(range(7, 41))


def _app(base, config: ServerConfig, **engine):
    args = EngineArgs(model=str(base), max_model_len=128, kv_cache_memory=16 << 20, **engine)
    return build_app(args.create_engine_config(), config)


def _started(app):
    from starlette.testclient import TestClient

    http = TestClient(app)
    http.__enter__()
    deadline = time.monotonic() + 120
    while http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the in-process engine did not start"
        time.sleep(0.1)
    return http


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("qwen3")
    root = tmp_path_factory.mktemp("served")
    paths = {
        "r4": make_adapter(base, root / "r4", 4, ["q_proj", "v_proj"], 8, seed=1),
        "r8": make_adapter(base, root / "r8", 8, ALL, 16, rslora=True, seed=2, std=0.2),
        "r16": make_adapter(base, root / "r16", 16, ["o_proj", "down_proj"], 32, seed=3),
    }
    modules = [f"r4={paths['r4']}", json.dumps({"name": "r8", "path": str(paths["r8"]),
                                                "base_model_name": "tiny-base"})]  # fmt: skip
    app = _app(base, ServerConfig(lora_modules=modules), enable_lora=True, max_loras=2,
               max_lora_rank=16, enable_runtime_lora=True)  # fmt: skip
    http = _started(app)
    yield http, base, paths
    http.__exit__(None, None, None)


def _generate(http, model: str | None, max_tokens: int = 8):
    body = {"prompt_token_ids": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True} | ({"model": model} if model else {})  # fmt: skip
    return http.post("/v1/generate", json=body)


def test_models_lists_adapters_with_their_parent(served):
    http, _, paths = served
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    base_name = next(iter(cards))
    assert set(cards) == {base_name, "r4", "r8"}
    assert cards["r4"]["parent"] == base_name and cards["r4"]["root"] == str(paths["r4"])
    assert cards["r8"]["parent"] == "tiny-base"
    assert 'inferengine:lora_requests_info{max_lora="2"' in http.get("/metrics").text


def test_requests_pick_adapters_by_model_in_one_batch(served):
    http, base, paths = served
    names = [None, "r4", "r8", "r4", None, "r8"]
    with ThreadPoolExecutor(len(names)) as pool:
        replies = list(pool.map(lambda m: _generate(http, m, 8), names))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    tokens = [r.json()["choices"][0]["token_ids"] for r in replies]
    want = {None: hf_greedy(hf_model(base), PROMPT, 8)}
    want |= {n: hf_greedy(peft_model(base, paths[n]), PROMPT, 8) for n in ("r4", "r8")}
    assert tokens == [want[n] for n in names]
    assert want["r4"] != want[None] and want["r8"] != want[None]


def test_chat_responses_and_messages_take_the_adapter_by_model(served):
    http, _, _ = served
    chat = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 8,
            "temperature": 0}  # fmt: skip

    def reply(model: str | None) -> str:
        r = http.post("/v1/chat/completions", json=chat | ({"model": model} if model else {}))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert reply("r8") == reply("r8") != reply(None)
    body = {"model": "r8", "input": "Hi there", "max_output_tokens": 8, "temperature": 0}
    assert http.post("/v1/responses", json=body).status_code == 200
    messages = {"model": "r8", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    assert http.post("/v1/messages", json=messages).status_code == 200
    assert http.post("/v1/messages", json=messages | {"model": "nope"}).status_code == 404


def test_an_unknown_model_is_404_model_not_found(served):
    http, _, _ = served
    reply = _generate(http, "no-such-adapter")
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"


def test_adapters_load_and_unload_while_others_run(served):
    http, base, paths = served
    with ThreadPoolExecutor(1) as pool:
        long_run = pool.submit(_generate, http, "r4", 40)
        loaded = http.post("/v1/load_lora_adapter",
                           json={"lora_name": "r16", "lora_path": str(paths["r16"])})  # fmt: skip
        assert loaded.status_code == 200, loaded.text
        assert "r16" in {c["id"] for c in http.get("/v1/models").json()["data"]}
        r16 = _generate(http, "r16", 8)
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "r16"})
        assert unloaded.status_code == 200, unloaded.text
        r4_tokens = long_run.result().json()["choices"][0]["token_ids"]
    assert r16.json()["choices"][0]["token_ids"] == hf_greedy(
        peft_model(base, paths["r16"]), PROMPT, 8
    )
    assert r4_tokens == hf_greedy(peft_model(base, paths["r4"]), PROMPT, 40)
    assert _generate(http, "r16").status_code == 404
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "r16"})
    assert again.status_code == 404
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    taken = http.post("/v1/load_lora_adapter",
                      json={"lora_name": "r4", "lora_path": str(paths["r4"])})  # fmt: skip
    assert taken.status_code == 400 and "already served" in taken.json()["error"]["message"]


def test_runtime_updates_and_modules_need_their_flags(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("qwen3")
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        _app(base, ServerConfig(lora_modules=[f"a={tmp_path}"]))
    with pytest.raises(ConfigError, match="--lora-modules a: LoRA adapter"):
        _app(base, ServerConfig(lora_modules=[f"a={tmp_path}"]), enable_lora=True)
    http = _started(_app(base, ServerConfig(), enable_lora=True))
    try:
        reply = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert reply.status_code == 404
        assert "--enable-runtime-lora" in reply.json()["error"]["message"]
    finally:
        http.__exit__(None, None, None)


def test_the_serve_flags_in_vllm_spelling():
    from inferengine.entrypoints.cli.main import build_parser

    json_form = '{"name": "b", "path": "/y", "base_model_name": "m"}'
    args = build_parser().parse_args(
        ["serve", "m", "--enable-lora", "--lora-modules", "a=/x", json_form, "--max-loras", "3",
         "--max-lora-rank", "64", "--max-cpu-loras", "8", "--enable-runtime-lora"]
    )  # fmt: skip
    assert args.lora_modules == ["a=/x", json_form]
    engine = EngineArgs.from_cli_args(args)
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 3, 64)
    assert (engine.max_cpu_loras, engine.enable_runtime_lora) == (8, True)
    from inferengine.lora.registry import LoRAModule, parse_lora_module

    assert parse_lora_module(json_form) == LoRAModule("b", "/y", "m")
    with pytest.raises(ConfigError, match="name=path"):
        parse_lora_module("just-a-path")
