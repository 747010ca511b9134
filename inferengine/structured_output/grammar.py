"""Grammars from `StructuredOutputsParams`, through llguidance.

Why llguidance (measured on the Qwen2.5 tokenizer, a nested JSON schema, 2 CPU cores, see the
issue note): it compiles lazily (1 ms for the schema against xgrammar's 6 ms, and no step waits
for a whole automaton), computes a token mask in 13 µs (median; xgrammar 3 µs, both far below
a decode step), fills numpy bitmasks, so the engine core stays free of torch, and reads JSON
schemas, regexes, choices, Lark and GBNF grammars (vLLM's `grammar` field) alike; a grammar in
llguidance's own JSON form (a list of grammars that may reference each other) passes as it is.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from inferengine.errors import InvalidRequestError, excerpt
from inferengine.logger import init_logger
from inferengine.sampling_params import StructuredOutputsParams
from inferengine.structured_output.token_bytes import tokenizer_from_bytes

logger = init_logger(__name__)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (compact JSON: no whitespace between tokens)."""
    return _grammar_text(*params.key, params.disable_any_whitespace)


@lru_cache(maxsize=256)
def _grammar_text(kind: str, text: str, compact: bool) -> str:
    import llguidance

    defaults = {"whitespace_flexible": not compact}
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=defaults)
    if kind == "json_object":
        schema = json.dumps({"type": "object"})
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if kind == "regex":
        return llguidance.grammar_from("regex", text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    if _is_grammar_list(text):  # llguidance's own form
        return text
    return llguidance.grammar_from("gbnf" if "::=" in text else "lark", text)


def _is_grammar_list(text: str) -> bool:
    """llguidance's JSON form, `{"grammars": [...]}`, rather than Lark or GBNF text."""
    return text.lstrip().startswith("{")


def grammar_list(params: StructuredOutputsParams) -> tuple[str, list[dict[str, Any]]]:
    """`params`' grammar as llguidance's list of grammars, and the name of the first (where it
    starts), by which a Lark grammar put before them in one list reaches it (`@name`)."""
    text = grammar_text(params)
    if _is_grammar_list(text):
        grammars = json.loads(text)["grammars"]
    else:  # Lark text
        grammars = [{"lark_grammar": text}]
    name = grammars[0].get("name") or "answer"
    grammars[0]["name"] = name
    return name, grammars


def check_grammar(params: StructuredOutputsParams, tokenizer: Any) -> None:
    """Raise `InvalidRequestError` naming the problem if llguidance refuses the grammar;
    `tokenizer` is an `llguidance.LLTokenizer` (or None to check the syntax only)."""
    import llguidance

    param = f"structured_outputs.{params.kind}"
    try:
        text = grammar_text(params)
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    except (ValueError, TypeError, RuntimeError) as e:
        error = str(e)
    if error:
        raise InvalidRequestError(
            f"the {params.kind} given for structured output is not usable: "
            f"{excerpt(error.strip())}",
            param=param,
        )


def mask_width(hf_tokenizer: Any, vocab_size: int) -> int:
    """Token ids a mask covers: the model's vocabulary (logits width), or the tokenizer's if it
    has more (added tokens past the embedding, which the worker's mask cuts off again)."""
    return max(vocab_size, len(hf_tokenizer))


def make_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of the tokenizer, over `mask_width` ids; every id that ends a request
    counts as its end of text. A tokenizer llguidance's importer cannot read (a decoder it does
    not know, a slow tokenizer) gets a token table from its own decoded bytes instead."""
    import llguidance.hf

    n_vocab = mask_width(hf_tokenizer, vocab_size)
    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token_ids)
    except Exception as e:  # the importer's refusal is a ValueError or a Rust error
        logger.info(
            "llguidance's tokenizer importer refused this tokenizer (%s); structured output "
            "uses a token table built from the tokenizer's decoded bytes",
            str(e).strip(),
        )
        return tokenizer_from_bytes(hf_tokenizer, n_vocab, eos_token_ids)
