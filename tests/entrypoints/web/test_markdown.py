"""The page's Markdown renderer (`static/markdown.js`), run in the browser on crafted text: it
builds elements only for Markdown, never for HTML in the text, and links only to safe URLs."""

from __future__ import annotations

import pytest

RENDER = """async (source) => {
    const { renderMarkdown } = await import('/web/markdown.js');
    const box = document.createElement('div');
    box.append(renderMarkdown(source));
    const tags = [...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase());
    const links = [...box.querySelectorAll('a')].map((a) => a.getAttribute('href'));
    return { tags, links, text: box.textContent, html: box.innerHTML };
}"""


@pytest.fixture
def render(page):
    return lambda source: page.evaluate(RENDER, source)


def test_html_in_the_text_stays_text(render):
    source = (
        "<script>alert(1)</script>\n\n<img src=x onerror=alert(2)> *a* `<b>`\n\n"
        "<div onclick='x()'>d</div>\n- <svg onload=alert(3)>\n\n> <iframe src=/>"
    )
    out = render(source)
    assert set(out["tags"]) <= {"p", "em", "code", "br", "ul", "li", "blockquote"}
    for fragment in (
        "<script>alert(1)</script>",
        "<img src=x onerror=alert(2)>",
        "<b>",
        "<svg onload=alert(3)>",
        "<iframe src=/>",
    ):
        assert fragment in out["text"]
    assert "<script" not in out["html"] and "&lt;script&gt;" in out["html"]


def test_links_only_to_safe_urls(render):
    out = render(
        "[a](https://example.com/x) [b](javascript:alert(1)) [c](JaVaScRiPt:alert(1)) "
        "[d](data:text/html,x) [e](mailto:a@b.c) <https://x.org> see http://y.org/p."
    )
    assert out["links"] == [
        "https://example.com/x",
        "mailto:a@b.c",
        "https://x.org/",
        "http://y.org/p",
    ]
    assert "[b]" not in out["text"] and "b" in out["text"]  # unsafe links keep their label


def test_blocks(render):
    source = (
        "# Title\n\nSome **bold** and _it_ and ~~gone~~ and \\*stars\\*.\n\n"
        "```python\nprint('<hi>')\n```\n\n"
        "1. one\n2. two\n   - nested\n\n"
        "| a | b |\n|---|--:|\n| 1 | 2 |\n\n---\n> quoted\n\n- [x] done"
    )
    out = render(source)
    for tag in (
        "h1",
        "strong",
        "em",
        "del",
        "pre",
        "code",
        "ol",
        "ul",
        "table",
        "th",
        "td",
        "hr",
        "blockquote",
        "input",
    ):
        assert tag in out["tags"], tag
    assert "*stars*" in out["text"] and "print('<hi>')" in out["text"]
    assert out["tags"].count("li") == 4


def test_an_unclosed_fence_while_streaming(render):
    out = render("Look:\n```js\nlet a = '<script>';")
    assert out["tags"] == ["p", "pre", "code"]
    assert out["text"].endswith("let a = '<script>';")
