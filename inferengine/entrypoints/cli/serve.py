"""`inferengine serve [MODEL]`: the OpenAI-compatible server under uvicorn, drained on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any, NoReturn

from inferengine import envs
from inferengine.engine.arg_utils import EngineArgs
from inferengine.entrypoints.openai.config import ServerConfig
from inferengine.errors import ConfigError

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_SERVER_HELP = {
    "host": "address to listen on (0.0.0.0: every interface)",
    "port": "port to listen on",
    "api_key": "require `Authorization: Bearer <key>` on the API routes (not /health, /metrics)",
    "max_request_body_bytes": "larger request bodies get 413",
    "uvicorn_log_level": "uvicorn's log level",
    "enable_access_log": "log one uvicorn access line per HTTP request (client, method, path, "
    "status), /health and /metrics polls included (vLLM logs them unless "
    "--disable-uvicorn-access-log); needs --uvicorn-log-level info or lower",
    "disable_uvicorn_access_log": "vLLM's flag, for its command lines: no access log, even with "
    "--enable-access-log",
    "enable_log_requests": "log one line per request: its id, prompt tokens and parameters",
    "disable_log_requests": "deprecated, does nothing: request logging is off by default",
    "max_log_len": "cut each logged request's parameters to this many characters",
    "max_n": "the largest n a request may ask for (OpenAI's limit is 128)",
    "max_request_seqs": "the most sequences (prompts x n) one request may ask for; "
    "0: 64 x --max-num-seqs",
    "drain_timeout": "on SIGTERM, seconds from the signal to the process's exit (within 0.3 s; "
    "sooner once nothing runs): new requests get 503, running ones may finish; then open "
    "streams end with an error event and [DONE], and the engine stops (a second signal ends "
    "the drain at once)",
    "enable_auto_tool_choice": 'serve tool_choice "auto" on chat (needs --tool-call-parser)',
    "tool_call_parser": "how to find tool calls in the model's text for tool_choice auto",
    "exclude_tools_when_tool_choice_none": 'leave tools out of the prompt with tool_choice "none"',
    "reasoning_parser": "split the model's <think> block into reasoning_content",
    "disable_web_ui": "no web page at / (a chat playground and a live view of the engine; it "
    "loads without the API key, then asks for it)",
    "responses_store_max": "/v1/responses keeps at most this many responses (store: true) for "
    "previous_response_id and GET /v1/responses/{id}, dropping the oldest first",
    "responses_store_bytes": "the most bytes (as JSON) the /v1/responses store holds, dropping "
    "the oldest responses first",
    "responses_store_ttl": "seconds a stored /v1/responses response is kept",
    "lora_modules": "LoRA adapters to serve, each name=path or vLLM's JSON form with name, path "
    "and base_model_name; a request picks one by model (needs --enable-lora)",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /tokenize, /health, /metrics, ...). Every flag can "
        "also be set as INFERENGINE_<FLAG>, e.g. INFERENGINE_PORT=9000.",
    )
    add_server_args(parser.add_argument_group("server"))
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))
    parser.set_defaults(func=run)


def add_server_args(parser: argparse._ActionsContainer) -> None:
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        env = envs.cli_default(f.name)
        help_text = _SERVER_HELP[f.name]
        if f.name == "lora_modules":
            parser.add_argument(flag, nargs="+", default=[], metavar="NAME=PATH", help=help_text)
            continue
        if f.type == "bool":
            default = env.lower() in ("1", "true", "yes", "on") if env is not None else f.default
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
            continue
        kind: Any = {"int": int, "float": float}.get(str(f.type), str)
        try:
            default = kind(env) if env is not None else f.default
        except ValueError as e:
            raise ConfigError(f"INFERENGINE_{f.name.upper()}={env!r} is not a valid value.") from e
        parser.add_argument(
            flag, type=kind, default=default, choices=_choices().get(f.name), help=help_text
        )


def _choices() -> dict[str, tuple[str, ...]]:
    from inferengine.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from inferengine.entrypoints.openai.tool_parsers import TOOL_PARSERS

    return {
        "uvicorn_log_level": _LOG_LEVELS,
        "tool_call_parser": tuple(TOOL_PARSERS),
        "reasoning_parser": tuple(REASONING_PARSERS),
    }


def run(args: argparse.Namespace) -> int:
    from inferengine.entrypoints.openai.api_server import run_server

    server_config = ServerConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}
    )
    engine_config = EngineArgs.from_cli_args(args).create_engine_config()
    pc = engine_config.parallel_config
    if pc.data_parallel_size > 1 or pc.distributed_executor_backend == "ray":
        from inferengine.dp.ray_backend import import_ray

        import_ray()  # refused here, before the server starts, if Ray is missing
    exit_now(
        asyncio.run(
            run_server(
                engine_config, server_config, lambda state: print_banner(state, server_config)
            )
        )
    )


def exit_now(code: int) -> NoReturn:
    """End the process once the server has stopped: the engine core is stopped and every request
    answered, so run the exit handlers (log flushing, Ray's shutdown) and skip the interpreter's
    teardown of torch and friends, which takes seconds on a busy host and would count against
    --drain-timeout and delay a supervisor's restart after the engine died."""
    import atexit
    import logging
    import os

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def print_banner(state: Any, config: ServerConfig) -> None:
    from inferengine import __version__

    ec = state.engine_config
    mc, cc = ec.model_config, ec.cache_config
    info = state.engine.ready_info if state.engine is not None else {}
    pages = max(0, int(info.get("num_blocks", cc.num_blocks)) - 1)
    url = f"http://{config.host}:{config.port}"
    lines = [
        f"InferEngine {__version__} serving {mc.name!r} ({mc.architecture})",
        f"  model       {mc.model_path}",
        f"  device      {ec.device}, dtype {mc.dtype}, attention {info.get('attention_backend')}",
        f"  KV cache    {pages} pages x {cc.block_size} tokens = {pages * cc.block_size} tokens",
        f"  limits      max_model_len {mc.max_model_len}, "
        f"max_num_seqs {ec.scheduler_config.max_num_seqs}",
        f"  API key     {'required' if config.api_key else 'none'}",
        *(
            [f"  replicas    {info['data_parallel_size']} on Ray (KV pages above: all of them)"]
            if info.get("data_parallel_size")
            else []
        ),
        f"  URL         {url}/v1  (health {url}/health, metrics {url}/metrics)",
        *([] if config.disable_web_ui else [f"  web page    {url}/  (chat, live engine view)"]),
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
