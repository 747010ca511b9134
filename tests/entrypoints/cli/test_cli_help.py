"""`--help` of every subcommand shows each flag's default (vLLM's --help does), unless the flag's
help already says it in words."""

from __future__ import annotations

import re

import pytest

from inferengine.entrypoints.cli.main import main


def help_text(capsys, monkeypatch, *argv: str) -> str:
    """The help `inferengine ARGV --help` prints (on a wide terminal)."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def flags(text: str) -> dict[str, str]:
    """Each flag's entry (its invocation and help, on one line), by each of its option strings."""
    entries: list[str] = []
    for line in text.splitlines():
        if re.match(r"  \S", line):  # an argument's entry starts
            entries.append(line.strip())
        elif re.match(r"\s{3,}\S", line) and entries and entries[-1]:
            entries[-1] += " " + line.strip()
        else:
            entries.append("")  # anything else (usage, a group's title) ends an entry
    by_flag = {}
    for entry in (e for e in entries if e.startswith("-")):
        invocation = re.findall(r"(?:^|, )(-{1,2}[\w-]+)", entry.split("  ")[0])
        for option in invocation:
            by_flag[option] = " ".join(entry.split())
    return by_flag


def flag_line(text: str, flag: str) -> str:
    return flags(text)[flag]


def test_serve_help_shows_every_default(capsys, monkeypatch):
    text = help_text(capsys, monkeypatch, "serve")
    assert flag_line(text, "--max-num-seqs").endswith("most requests in one step (default: 256)")
    assert flag_line(text, "--port").endswith("(default: 8000)")
    assert flag_line(text, "--drain-timeout").endswith("(default: 30.0)")
    assert flag_line(text, "--enable-access-log").endswith("(default: off)")
    assert flag_line(text, "--enable-prefix-caching").endswith("(default: on)")
    assert flag_line(text, "--api-key").endswith("(default: none)")
    # a help that explains its default in words keeps them, and only them
    tokenizer = flag_line(text, "--tokenizer")
    assert tokenizer.endswith("(default: the model's)") and tokenizer.count("default") == 1
    # every flag of serve says its default
    entries = set(flags(text).values())
    assert len(entries) > 40
    assert [e for e in entries if "default" not in e.lower()] == [
        "-h, --help show this help message and exit"
    ]


def test_help_shows_the_default_in_effect(capsys, monkeypatch):
    """A default from the environment (INFERENGINE_<FLAG>) is the one shown."""
    monkeypatch.setenv("INFERENGINE_MAX_NUM_SEQS", "7")
    text = help_text(capsys, monkeypatch, "serve")
    assert flag_line(text, "--max-num-seqs").endswith("(default: 7)")


def test_other_subcommands_show_defaults(capsys, monkeypatch):
    generate = help_text(capsys, monkeypatch, "generate")
    assert flag_line(generate, "--system").endswith("(default: none)")
    assert flag_line(generate, "--block-size").endswith("(default: 16)")
    batch = help_text(capsys, monkeypatch, "run-batch")
    assert flag_line(batch, "--parquet-rows-per-part").endswith("(default: 4096)")
    assert "(default: none)" not in flag_line(batch, "--input-file")  # required
    assert "\n  openai   JSONL in the OpenAI Batch API format" in batch  # laid out by hand, kept
    bench = help_text(capsys, monkeypatch, "bench", "serve")
    assert flag_line(bench, "--num-prompts").endswith("default: 1000")  # a flag without help
