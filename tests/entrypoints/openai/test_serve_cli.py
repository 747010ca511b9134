"""`inferengine serve` flags: engine flags in vLLM's spelling plus the server's, each settable by env."""

from __future__ import annotations

import argparse

from inferengine.entrypoints.cli.main import build_parser
from inferengine.entrypoints.cli.serve import add_server_args


def test_serve_flags_and_defaults():
    args = build_parser().parse_args(
        ["serve", "some-model", "--port", "9001", "--api-key", "k", "--max-num-seqs", "4"]
    )
    assert (args.model, args.port, args.api_key, args.max_num_seqs) == ("some-model", 9001, "k", 4)
    assert args.host == "127.0.0.1" and args.disable_log_requests is False
    assert args.max_waiting_requests is None and args.enable_prefix_caching is True


def test_server_flags_from_environment(monkeypatch):
    monkeypatch.setenv("INFERENGINE_PORT", "9100")
    monkeypatch.setenv("INFERENGINE_HOST", "0.0.0.0")
    monkeypatch.setenv("INFERENGINE_DISABLE_LOG_REQUESTS", "1")
    monkeypatch.setenv("INFERENGINE_MAX_REQUEST_BODY_BYTES", "1024")
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args([])
    assert (args.port, args.host, args.disable_log_requests) == (9100, "0.0.0.0", True)
    assert args.max_request_body_bytes == 1024
    assert parser.parse_args(["--port", "1"]).port == 1  # a flag beats the environment


def test_tool_and_reasoning_flags(monkeypatch, capsys):
    import pytest

    from inferengine.entrypoints.cli.main import main
    from inferengine.entrypoints.openai.config import ServerConfig
    from inferengine.errors import ConfigError

    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "llama3_json",
            "--reasoning-parser",
            "deepseek_r1",
        ]
    )
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"
    assert args.reasoning_parser == "deepseek_r1" and not args.exclude_tools_when_tool_choice_none
    defaults = build_parser().parse_args(["serve", "m"])
    assert defaults.tool_call_parser is None and defaults.reasoning_parser is None
    with pytest.raises(SystemExit):  # not a parser's name
        build_parser().parse_args(["serve", "m", "--tool-call-parser", "nope"])
    monkeypatch.setenv("INFERENGINE_TOOL_CALL_PARSER", "mistral")
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert parser.parse_args([]).tool_call_parser == "mistral"
    # vLLM's rule: auto tool choice needs a parser; the command fails before loading a model
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    monkeypatch.delenv("INFERENGINE_TOOL_CALL_PARSER")
    assert main(["serve", "no-such-model", "--enable-auto-tool-choice"]) == 1
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


def test_access_log_flags():
    from inferengine.entrypoints.openai.config import ServerConfig

    def access_log(*flags: str) -> bool:
        args = build_parser().parse_args(["serve", "m", *flags])
        return ServerConfig(
            enable_access_log=args.enable_access_log,
            disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        ).access_log

    assert access_log() is False  # off by default, unlike vLLM
    assert access_log("--enable-access-log") is True
    # vLLM's flag is accepted, and wins
    assert access_log("--disable-uvicorn-access-log") is False
    assert access_log("--enable-access-log", "--disable-uvicorn-access-log") is False
