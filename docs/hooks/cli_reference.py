"""mkdocs hook: fills reference/cli.md from the live `inferengine` argument parsers.

Every subcommand's flags, with type, default and help, come from `build_parser()` at build time,
so the page never drifts from the code. The defaults shown are the code's: any
`INFERENGINE_<FLAG>` variable in the building shell is set aside while the parsers are built.
Importable without mkdocs (the docs tests call `render()`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

PAGE = "reference/cli.md"
# Subcommand paths in page order; `bench` has subcommands of its own.
COMMANDS = (
    ("generate",),
    ("serve",),
    ("run-batch",),
    ("router",),
    ("bench", "serve"),
    ("bench", "paired"),
    ("bench", "agent"),
    ("bench", "plot"),
)
INTRO = """\
# CLI reference

Generated from the argument parsers when the site is built (`docs/hooks/cli_reference.py`);
`inferengine COMMAND --help` prints the same. Defaults are the code's.

Every engine flag (the *engine* group of `serve`, `generate` and `run-batch`) and every server
flag of `serve` also takes its default from the environment: `INFERENGINE_<FLAG>`, upper case
with underscores, e.g. `INFERENGINE_MAX_MODEL_LEN=4096` or `INFERENGINE_PORT=9000`. A flag on
the command line wins over the variable. Boolean engine flags come in pairs
(`--enable-prefix-caching` / `--no-enable-prefix-caching`).

Commands: {links}; the [engine flags](#engine-flags) are shared by the first three.
"""
ENGINE_GROUP = "engine"


@contextmanager
def _code_defaults() -> Iterator[None]:
    """Build the parsers with no `INFERENGINE_<FLAG>` variable set (they would change defaults)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("INFERENGINE_")}
    keep = {"INFERENGINE_CACHE_DIR"}
    for key in saved.keys() - keep:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Each subcommand's parser, keyed by its path (`("bench", "serve")`)."""
    from inferengine.entrypoints.cli.main import build_parser

    with _code_defaults():
        root = build_parser()
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if path:
            found[path] = parser
        for action in subs:
            for name, child in action.choices.items():
                walk(child, (*path, name))

    walk(root, ())
    return found


def option_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag and positional the parser takes (what the page must list)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        out.extend(action.option_strings or [action.metavar or action.dest])
    return out


def render() -> str:
    found = parsers()
    missing = set(found) - set(COMMANDS) - {("bench",)}
    if missing:  # a new subcommand: list it too rather than leave it out
        raise RuntimeError(f"cli_reference.COMMANDS lacks {sorted(missing)}")
    links = ", ".join(f"[`inferengine {' '.join(p)}`](#{_anchor(p)})" for p in COMMANDS)
    lines = [INTRO.format(links=links)]
    for path in COMMANDS:
        lines.extend(_command(path, found[path]))
    lines.extend(_engine_section(found[("generate",)]))
    return "\n".join(lines) + "\n"


def _engine_section(generate: argparse.ArgumentParser) -> list[str]:
    """The engine flags once: `serve`, `generate` and `run-batch` take the same group (`serve`
    takes the model as a positional argument, the other two as `--model`)."""
    group = next(g for g in generate._action_groups if g.title == ENGINE_GROUP)
    formatter = generate._get_formatter()
    lines = [
        "## Engine flags {#engine-flags}",
        "",
        "Taken by `serve`, `generate` and `run-batch` (`EngineArgs` in "
        "`inferengine/engine/arg_utils.py`; `LLM(...)` takes the same names as keyword "
        "arguments). `serve` takes the model as its positional argument, `generate` and "
        "`run-batch` as `--model`; `--data-parallel-size`, the `--router-*` flags and "
        "`--max-waiting-requests` apply to `serve` only.",
        "",
        *_table(("engine",), group._group_actions, formatter),
    ]
    return lines


def _anchor(path: tuple[str, ...]) -> str:
    return "inferengine-" + "-".join(path)


def _command(path: tuple[str, ...], parser: argparse.ArgumentParser) -> list[str]:
    name = "inferengine " + " ".join(path)
    lines = [f"## {name} {{#{_anchor(path)}}}", ""]
    if parser.description:
        raw = parser.formatter_class is argparse.RawDescriptionHelpFormatter
        text = parser.description.strip()
        lines += ["```text", text, "```", ""] if raw else [_cell(text), ""]
    positionals = [
        f"[{a.metavar or a.dest}]" if a.nargs == "?" else a.metavar or a.dest
        for a in parser._actions
        if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
    ]
    synopsis = " ".join([parser.prog, "[options]", *positionals])
    lines += ["```text", synopsis, "```", ""]
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        ]
        if not actions:
            continue
        if group.title == ENGINE_GROUP:
            positional = [a.dest for a in actions if not a.option_strings]
            note = f"; the model is the positional `{positional[0]}` here" if positional else ""
            lines += [f"**engine**: the [engine flags](#engine-flags){note}.", ""]
            continue
        title = {"positional arguments": "arguments", "options": "options"}.get(
            group.title or "", group.title or "options"
        )
        lines += [f"**{title}**", "", *_table(path, actions, formatter)]
    if parser.epilog:
        lines += ["```text", parser.epilog.strip(), "```", ""]
    return lines


def _table(path: tuple[str, ...], actions: list[argparse.Action], formatter) -> list[str]:
    rows = [_row(path, a, formatter) for a in actions if not isinstance(a, argparse._HelpAction)]
    return ["| flag | type | default | description |", "| --- | --- | --- | --- |", *rows, ""]


def _row(path: tuple[str, ...], action: argparse.Action, formatter) -> str:
    names = action.option_strings or [action.metavar or action.dest]
    anchor = "-".join(path) + "-" + names[-1].lstrip("-")
    flag = " ".join(f"`{n}`" for n in names)
    help_text = formatter._expand_help(action) if action.help else ""
    if action.required:
        help_text = "**required.** " + help_text
    return (
        f'| <span id="{anchor}"></span>{flag} | {_type(action)} | {_default(action)} '
        f"| {_cell(help_text)} |"
    )


def _type(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "flag (`--no-…` to turn off)"
    if action.nargs == 0:
        return "flag"
    if action.choices:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    kind = getattr(action.type, "__name__", None) or "str"
    kind = {"_parse_bytes": "size (2GiB, 512MB, bytes)", "_json_object": "JSON object"}.get(
        kind, kind
    )
    if isinstance(action, argparse._AppendAction):
        kind += ", repeatable"
    if action.nargs in ("?", "*", "+"):
        kind += {"?": ", optional", "*": ", zero or more", "+": ", one or more"}[action.nargs]
    return kind


def _default(action: argparse.Action) -> str:
    if action.required or action.default is argparse.SUPPRESS:
        return ""
    if action.default is None:
        return "none"
    if isinstance(action.default, bool):
        return "on" if action.default else "off"
    return f"`{_cell(str(action.default))}`"


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, angle brackets escaped outside code spans."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def on_page_markdown(markdown, page, config, files):
    """mkdocs event: the stub `docs/reference/cli.md` (what a repository browser shows) becomes
    the generated page."""
    if page.file.src_uri == PAGE:
        return render()
    return markdown
