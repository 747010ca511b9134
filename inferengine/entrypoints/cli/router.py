"""`inferengine router --prefill URL --decode URL`: the prefill/decode router for disaggregated
serving."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from typing import Any

from inferengine import envs
from inferengine.config import ROUTER_POLICIES
from inferengine.errors import ConfigError

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_HELP = {
    "prefill": "base URL of a prefill engine (`serve --kv-transfer-config "
    '\'{"kv_role":"kv_producer"}\'`); repeat for several',
    "decode": "base URL of a decode engine (`serve --kv-transfer-config "
    '\'{"kv_role":"kv_consumer"}\'`); repeat for several',
    "host": "address to listen on (0.0.0.0: every interface)",
    "port": "port to listen on",
    "api_key": "require `Authorization: Bearer <key>` on the API routes and send it to the "
    "engines; unset, a client's Authorization header goes to the engines as it came",
    "policy": "how a prefill engine is picked: cache-aware (the longest cached prefix, from the "
    "engines' KV events, net of load) or round-robin",
    "connect_timeout": "seconds to connect to an engine",
    "prefill_timeout": "seconds a prefill engine may take to answer; then another is tried",
    "request_timeout": "seconds without a byte from a decode engine before its request fails",
    "health_check_interval": "seconds between polls of each engine's /health (and of a prefill "
    "engine's /kv_events)",
    "uvicorn_log_level": "uvicorn's log level",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router",
        help="route requests over prefill and decode engines (disaggregated serving)",
        description="One OpenAI-compatible endpoint (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) over prefill and decode engines: each request is "
        "prefilled on the prefill engine that holds most of its prompt and decoded on the "
        "least loaded decode engine, the KV pages passed between them (docs: "
        "disaggregated.md). Every flag can also be set as INFERENGINE_<FLAG>.",
    )
    add_router_args(parser)
    parser.set_defaults(func=run)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    from inferengine.entrypoints.router.config import RouterServerConfig

    for f in dataclasses.fields(RouterServerConfig):
        flag = "--" + f.name.replace("_", "-")
        env = envs.cli_default(f.name)
        if f.name in ("prefill", "decode"):
            parser.add_argument(
                flag,
                action="append",
                metavar="URL",
                required=env is None,  # else the variable's URLs, separated by commas
                help=_HELP[f.name] + f" (default: ${envs.CLI_PREFIX}{f.name.upper()}, URLs "
                "separated by commas)",
            )
            continue
        kind: Any = {"int": int, "float": float}.get(str(f.type), str)
        try:
            default = kind(env) if env is not None else f.default
        except ValueError as e:
            raise ConfigError(f"INFERENGINE_{f.name.upper()}={env!r} is not a valid value.") from e
        choices = {"policy": ROUTER_POLICIES, "uvicorn_log_level": _LOG_LEVELS}.get(f.name)
        parser.add_argument(flag, type=kind, default=default, choices=choices, help=_HELP[f.name])


def run(args: argparse.Namespace) -> int:
    from inferengine.entrypoints.router.app import run_router
    from inferengine.entrypoints.router.config import RouterServerConfig

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterServerConfig)}
    for name in ("prefill", "decode"):
        if not values[name]:  # not on the command line: the variable's
            values[name] = (envs.cli_default(name) or "").split(",")
    config = RouterServerConfig(**values)
    asyncio.run(run_router(config))
    return 0
