"""The manual stays in step with the code: the generated CLI reference lists every flag of every
subcommand with its default, the serving page's table of common flags gives the parser's
defaults, and every link in the README (files and #anchors into docs/) resolves.
`mkdocs build --strict` (in .ci/run) checks the links between docs pages."""

from __future__ import annotations

import argparse
import re
import unicodedata
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def load_hook():
    return load_script("docs/hooks/cli_reference.py")


@pytest.fixture(scope="module")
def hook():
    return load_hook()


@pytest.fixture(scope="module")
def page(hook) -> str:
    return hook.render()


def test_every_subcommand_is_documented(hook):
    found = set(hook.parsers())
    for path in (("serve",), ("generate",), ("run-batch",), ("bench", "serve")):
        assert path in found
    assert found - {("bench",)} == set(hook.COMMANDS)


def test_every_flag_appears_with_its_default(hook, page):
    for path, parser in hook.parsers().items():
        if path == ("bench",):
            continue
        for group in parser._action_groups:
            engine = group.title == hook.ENGINE_GROUP
            for action in group._group_actions:
                if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                    continue
                names = action.option_strings or [action.metavar or action.dest]
                for name in names:
                    assert f"`{name}`" in page, f"inferengine {' '.join(path)} {name}: not listed"
                if engine and not action.option_strings:
                    continue  # serve's positional model: the engine table's --model row
                anchor = "-".join(("engine",) if engine else path) + "-" + names[-1].lstrip("-")
                row = _row(page, anchor)
                default = hook._default(action)
                assert default in row, f"{anchor}: default {default!r} not in {row!r}"
                if action.help:
                    first_words = " ".join(action.help.split()[:3])
                    assert hook._cell(first_words) in row, f"{anchor}: help missing"


def _row(page: str, anchor: str) -> str:
    rows = [line for line in page.splitlines() if f'<span id="{anchor}">' in line]
    assert len(rows) == 1, anchor
    return rows[0]


def test_reference_uses_the_code_defaults_not_the_environment(hook, monkeypatch):
    monkeypatch.setenv("INFERENGINE_PORT", "9999")
    monkeypatch.setenv("INFERENGINE_MAX_NUM_SEQS", "3")
    text = hook.render()
    assert "`9999`" not in text and "| `8000` |" in text
    assert "| `256` |" in _row(text, "engine-max-num-seqs")


def test_engine_flags_are_shared_and_listed_once(page):
    assert page.count("`--max-model-len`") == 1
    assert "## Engine flags {#engine-flags}" in page
    assert "`--kv-cache-memory` | size (2GiB, 512MB, bytes)" in page


# ---- prose defaults against the parser ------------------------------------------------------


def test_serving_defaults_table_matches_the_parser(hook):
    """docs/serving.md's table of the flags most often changed: every literal default (a number,
    `code`, none, on, off) is the parser's."""
    serve = hook.parsers()[("serve",)]
    defaults = {o: a.default for a in serve._actions for o in a.option_strings}
    words = {"none": None, "on": True, "off": False}
    checked = 0
    for line in (DOCS / "serving.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`--"):
            continue
        flags = re.findall(r"`(--[\w-]+)`", cells[0])
        shown = [s.strip() for s in cells[1].split(",")]
        if len(shown) == 1:
            shown *= len(flags)
        if len(shown) != len(flags):
            continue
        for flag, value in zip(flags, shown, strict=True):
            assert flag in defaults, f"serving.md: {flag} is not a serve flag"
            literal = re.fullmatch(r"`([^`]*)`|(\d+(?:\.\d+)?)(?: s)?|(none|on|off)", value)
            if not literal:
                continue  # described, not a literal: 'the model as given'
            code, number, word = literal.groups()
            want = defaults[flag]
            if word:
                assert want is words[word], f"serving.md: {flag} default {value}, parser {want!r}"
            elif number:
                assert float(number) == float(want), f"serving.md: {flag} {value}, parser {want!r}"
            else:
                assert code == str(want), f"serving.md: {flag} {value}, parser {want!r}"
            checked += 1
    assert checked >= 10


# ---- README links --------------------------------------------------------------------------


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slugify(text: str) -> str:
    """Python-Markdown's toc slug (mkdocs' heading ids), on the heading's rendered text."""
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: str) -> set[str]:
    found = set()
    in_fence = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            text = heading.group(1)
            explicit = re.search(r"\{#([\w-]+)\}\s*$", text)
            found.add(explicit.group(1) if explicit else slugify(text))
        found.update(re.findall(r'id="([\w-]+)"', line))
    return found


def page_text(path: Path, hook) -> str:
    if path == DOCS / "reference" / "cli.md":
        return hook.render()  # the stub on disk becomes this page when the site is built
    return path.read_text(encoding="utf-8")


def test_every_readme_link_resolves(hook):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = LINK.findall(readme)
    assert len(targets) > 10
    for target in targets:
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        path = (ROOT / file_part).resolve() if file_part else ROOT / "README.md"
        assert path.exists(), f"README links to {target}, which does not exist"
        if anchor:
            assert path.suffix == ".md", target
            assert anchor in anchors(page_text(path, hook)), f"README: no #{anchor} in {path}"


def test_readme_is_a_landing_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert not re.search(r"\b[0-9a-f]{7,40}\b", readme), "no commit hashes in the README"
    assert "<!-- test-command -->\n```bash\n" in readme


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.rglob("*.md"):
        relative = page.relative_to(DOCS).as_posix()
        assert f" {relative}\n" in nav, f"docs/{relative} is not in mkdocs.yml's nav"


def test_slugify_matches_mkdocs_where_installed():
    toc = pytest.importorskip("markdown.extensions.toc")
    for text in ("Qwen2.5-7B shape, FP8 weights and KV cache", "Sessions: leases", "`LLM`"):
        rendered = re.sub(r"`([^`]*)`", r"\1", text)
        assert slugify(text) == toc.slugify(rendered, "-")


def test_every_result_folder_named_in_the_docs_exists():
    """A quoted figure names its folder; a folder that left the tree takes its figure along,
    unless the sentence says the folder is in git history."""
    folder = re.compile(r"\d{8}T\d{6}Z-[\w.-]*\w")
    results = ROOT / "benchmarks" / "results"
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for line in page.read_text(encoding="utf-8").splitlines():
            for name in folder.findall(line):
                if "git history" in line:
                    continue
                assert (results / name).is_dir(), f"{page.name} quotes {name}, not in the tree"
