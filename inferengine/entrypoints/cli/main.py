"""`inferengine` command: dispatches to subcommands, each a module with `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys

from inferengine.version import __version__

# Each module defines `register(subparsers)`, which adds its parser and sets `func` on it.
SUBCOMMAND_MODULES = (
    "inferengine.entrypoints.cli.generate",
    "inferengine.entrypoints.cli.serve",
    "inferengine.entrypoints.cli.run_batch",
    "inferengine.bench.cli",
)


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
    return parser


def _version() -> str:
    return f"inferengine {__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from inferengine.errors import InferEngineError

    try:
        return int(args.func(args) or 0)
    except InferEngineError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
