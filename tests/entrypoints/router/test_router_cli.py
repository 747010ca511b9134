"""`inferengine router`'s flags: repeated URLs, INFERENGINE_<FLAG> defaults, refused settings."""

from __future__ import annotations

import dataclasses

import pytest

from inferengine.entrypoints.cli.main import build_parser
from inferengine.entrypoints.cli.router import run
from inferengine.entrypoints.router.config import RouterServerConfig
from inferengine.errors import ConfigError


def config_of(argv: list[str], monkeypatch) -> RouterServerConfig:
    """The config `inferengine router ARGV` would serve with (the server not started)."""
    captured = {}

    async def fake_run_router(config):
        captured["config"] = config

    monkeypatch.setattr("inferengine.entrypoints.router.app.run_router", fake_run_router)
    args = build_parser().parse_args(["router", *argv])
    assert run(args) == 0
    return captured["config"]


def test_repeated_urls_and_defaults(monkeypatch):
    config = config_of(
        ["--prefill", "http://a:1/", "--prefill", "http://b:2/v1", "--decode", "http://c:3"],
        monkeypatch,
    )
    assert (config.prefill, config.decode) == (["http://a:1", "http://b:2"], ["http://c:3"])
    defaults = {f.name: f.default for f in dataclasses.fields(RouterServerConfig)}
    assert (config.port, config.policy) == (defaults["port"], "cache-aware")


def test_urls_and_flags_from_the_environment(monkeypatch):
    monkeypatch.setenv("INFERENGINE_PREFILL", "http://a:1,http://b:2")
    monkeypatch.setenv("INFERENGINE_DECODE", "http://c:3")
    monkeypatch.setenv("INFERENGINE_PORT", "9100")
    config = config_of([], monkeypatch)
    assert (config.prefill, config.decode, config.port) == (
        ["http://a:1", "http://b:2"],
        ["http://c:3"],
        9100,
    )
    config = config_of(["--decode", "http://d:4"], monkeypatch)  # the command line wins
    assert config.decode == ["http://d:4"]


def test_urls_are_required(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--decode", "http://c:3"])
    assert "--prefill" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"prefill": ["a:1"], "decode": ["http://c:3"]}, "give the engine's URL"),
        ({"prefill": ["http://a:1", "http://a:1/"], "decode": ["http://c"]}, "twice"),
        ({"prefill": ["http://a"], "decode": []}, "at least one --decode"),
        ({"prefill": ["http://a"], "decode": ["http://c"], "policy": "random"}, "--policy"),
        ({"prefill": ["http://a"], "decode": ["http://c"], "prefill_timeout": 0}, "positive"),
    ],
)
def test_refused_settings(values, message):
    with pytest.raises(ConfigError, match=message):
        RouterServerConfig(**values)
