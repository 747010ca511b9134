"""`inferengine run-batch -i IN -o OUT`: a batch file through an in-process engine, resumable."""

from __future__ import annotations

import argparse
import json
from typing import Any

from inferengine.engine.arg_utils import EngineArgs

_DESCRIPTION = """\
Generate for every row of a batch file with the engine in this process (no HTTP server).

Input formats, by extension or --input-format:
  openai   JSONL in the OpenAI Batch API format: {"custom_id", "method", "url", "body"} per line,
           url /v1/completions or /v1/chat/completions; each output line is
           {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.
  jsonl    one flat JSON object per line with `prompt` or `messages` and optional request fields
           (max_tokens, temperature, top_p, top_k, seed, stop, ...); other fields pass through.
  csv      the same as columns (messages and lists as JSON text).
  parquet  the same as columns (messages as a list of structs or JSON text).
Plain outputs hold the input columns plus row_index, output_text, finish_reason,
prompt_tokens, completion_tokens and error. Results are written as rows finish (completion
order) unless --ordered. Rerunning with the same output skips the rows it already holds.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run-batch",
        help="generate for every row of a JSONL / CSV / Parquet batch file (resumable)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-i", "--input-file", required=True, help="the batch file to read")
    parser.add_argument("-o", "--output-file", required=True, help="where results go (appended)")
    parser.add_argument(
        "--input-format",
        choices=("openai", "jsonl", "csv", "parquet"),
        default=None,
        help="default: from the extension; .jsonl files with custom_id and body are openai",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="rows held at once (in the engine or awaiting their turn); default 4 × max-num-seqs",
    )
    parser.add_argument(
        "--ordered", action="store_true", help="write results in input order (default: as done)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar, logs only")
    parser.add_argument(
        "--defaults",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="request fields for plain rows that lack them, e.g. '{\"max_tokens\": 64}'",
    )
    parser.add_argument(
        "--parquet-rows-per-part",
        type=int,
        default=4096,
        help="Parquet output: rows per part file (and row group); a crash redoes at most these",
    )
    parser.add_argument(
        "--flush-seconds",
        type=float,
        default=30.0,
        help="Parquet output: write a part at least this often",
    )
    group = parser.add_argument_group("engine")
    EngineArgs.add_cli_args(group, model_positional=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from inferengine.engine.llm_engine import LLMEngine
    from inferengine.entrypoints.batch import BatchConfig, run_batch
    from inferengine.entrypoints.batch.runner import check_paths

    config = BatchConfig(
        input_path=args.input_file,
        output_path=args.output_file,
        input_format=args.input_format,
        max_in_flight=args.max_in_flight,
        ordered=args.ordered,
        quiet=args.quiet,
        defaults=args.defaults,
        parquet_rows_per_part=args.parquet_rows_per_part,
        flush_seconds=args.flush_seconds,
    )
    check_paths(config)  # before the model loads
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    summary = run_batch(engine, config)
    print(summary.describe(), flush=True)
    return 0


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
