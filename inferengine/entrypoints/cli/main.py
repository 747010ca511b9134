"""`inferengine` command: dispatches to subcommands, each a module with `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from inferengine.version import __version__

# Each module defines `register(subparsers)`, which adds its parser and sets `func` on it.
SUBCOMMAND_MODULES = (
    "inferengine.entrypoints.cli.generate",
    "inferengine.entrypoints.cli.serve",
    "inferengine.entrypoints.cli.run_batch",
    "inferengine.entrypoints.cli.router",
    "inferengine.bench.cli",
)


# Help that already says what its flag's default is: "(default: the model's)", "by default".
_STATES_DEFAULT = re.compile(r"\(default|default:|by default|default \d", re.IGNORECASE)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Ends each flag's help with its default, "(default: 256)", as vLLM's --help does, unless
    the help says it in words (what a flag left unset means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or _STATES_DEFAULT.search(text)
            or default is argparse.SUPPRESS
            or action.required
            or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
            or (not action.option_strings and action.nargs not in ("?", "*"))
        ):
            return action.help
        return f"{text} (default: {_shown(default)})"


def _shown(default: object) -> str:
    """A default as help shows it (escaped for argparse's %-formatting)."""
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default).replace("%", "%%")


class RawDescriptionDefaultsHelpFormatter(
    DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """The above, for parsers whose description and epilog are laid out by hand."""


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and every subcommand parser under it the formatters above (a flag without
    help text gets one that is just its default: argparse lists no help line otherwise)."""
    raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = RawDescriptionDefaultsHelpFormatter if raw else DefaultsHelpFormatter
    for action in parser._actions:
        if (
            action.help is None
            and action.option_strings
            and not action.required
            and action.default is not argparse.SUPPRESS
        ):
            action.help = f"default: {_shown(action.default)}"
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                show_defaults(subparser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferengine", description="LLM inference and serving engine."
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue  # subcommand not built yet
            raise
        module.register(subparsers)
    show_defaults(parser)
    return parser


def _version() -> str:
    return f"inferengine {__version__}"


def main(argv: list[str] | None = None) -> int:
    from inferengine.errors import InferEngineError

    try:
        parser = build_parser()  # reads the INFERENGINE_<FLAG> defaults
    except InferEngineError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except InferEngineError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
