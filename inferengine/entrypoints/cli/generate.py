"""`inferengine generate PROMPT`: one chat turn (or raw completion) on a model, printed."""

from __future__ import annotations

import argparse
import sys

from inferengine.engine.arg_utils import EngineArgs


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="answer one prompt with a model (default: smollm2-135m-instruct)",
        description="Answer one prompt; the model's chat template is applied unless --raw.",
    )
    parser.add_argument("prompt", help="the question or text to continue")
    parser.add_argument("--raw", action="store_true", help="continue the text, no chat template")
    model_default = "default: the model's generation_config.json (see --generation-config)"
    parser.add_argument("--max-tokens", type=int, default=None, help=f"{model_default}, else 128")
    parser.add_argument(
        "--temperature", type=float, default=None, help=f"{model_default}, else 1.0"
    )
    parser.add_argument("--top-p", type=float, default=None, help=f"{model_default}, else 1.0")
    parser.add_argument("--system", default=None, help="a system message for the chat")
    group = parser.add_argument_group("engine")
    EngineArgs.add_cli_args(group, model_positional=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from inferengine import LLM, SamplingParams
    from inferengine.sampling_params import sampling_defaults

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.max_num_seqs = 1
    llm = LLM(**vars(engine_args))
    # The defaults `LLM` and the server use (a longer answer than SamplingParams' 16 tokens
    # unless the model says), under the flags given.
    generation_config = llm.llm_engine.config.model_config.generation_config
    defaults = {"max_tokens": 128, **sampling_defaults(generation_config)}
    flags = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    params = SamplingParams(**(defaults | {k: v for k, v in flags.items() if v is not None}))
    if args.raw:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    else:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        output = llm.chat(messages, params, use_tqdm=False)[0]
    sys.stdout.write(output.outputs[0].text.strip() + "\n")
    return 0
