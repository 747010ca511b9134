"""Input-grounded prompts for the speculative-decoding benchmark: quote, edit or summarise a
given text or piece of code, in SmolLM2-Instruct's chat format.

The texts are functions and module docstrings of Python's standard library (the PSF licence
allows it), picked by name so the file is the same wherever it is rebuilt with the same Python
minor version. Writes benchmarks/data/grounded-smollm2.jsonl, one {"prompt": ...} per line,
for `--dataset-name custom` (sent as written: vLLM's --skip-chat-template).

    python benchmarks/grounded_prompts.py
"""

from __future__ import annotations

import importlib
import inspect
import json
import textwrap
from pathlib import Path

OUT = Path(__file__).parent / "data" / "grounded-smollm2.jsonl"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

FUNCTIONS = [
    ("textwrap", "dedent"), ("textwrap", "indent"), ("shlex", "split"), ("shlex", "quote"),
    ("fnmatch", "translate"), ("calendar", "weekday"), ("textwrap", "shorten"),
    ("calendar", "leapdays"), ("glob", "has_magic"), ("string", "capwords"),
    ("base64", "b64encode"), ("colorsys", "rgb_to_hls"),
]  # fmt: skip
DOCSTRINGS = ["textwrap", "shlex", "fnmatch", "heapq", "bisect", "difflib"]


def chat(user: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def prompts() -> list[str]:
    out = []
    for i, (module, name) in enumerate(FUNCTIONS):
        source = textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), name)))
        task = (
            "Repeat the following Python function exactly, adding a comment above each line:"
            if i % 3 == 0
            else f"Rewrite the following Python function, renaming it to `{name}_v2`; keep the "
            "rest as it is:"
            if i % 3 == 1
            else "Copy the following Python function, then explain what it does:"
        )
        out.append(chat(f"{task}\n\n```python\n{source}```"))
    for i, module in enumerate(DOCSTRINGS):
        doc = inspect.getdoc(importlib.import_module(module)) or ""
        task = (
            "Quote the following text word for word, then summarise it in one sentence:"
            if i % 2 == 0
            else "Summarise the following text, quoting its key sentences:"
        )
        out.append(chat(f"{task}\n\n{doc}"))
    return out


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": p}) for p in prompts()]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
