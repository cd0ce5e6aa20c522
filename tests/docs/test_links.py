"""Every relative link of README.md and docs/**/*.md lands on a file that
exists and, with a #fragment, on a heading of it (GitHub's anchors): a page
split or a renamed heading must carry its links along."""

import re
from collections import Counter
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from test_readme import DOCS, ROOT

_MD = MarkdownIt("commonmark")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def anchors(text: str) -> set:
    """GitHub's heading ids: lowercased, punctuation but - and _ dropped,
    spaces to -, a repeat suffixed -1, -2, ..."""
    tokens, out, seen = _MD.parse(text), set(), Counter()
    for i, tok in enumerate(tokens):
        if tok.type != "heading_open":
            continue
        words = "".join(child.content for child in tokens[i + 1].children or [])
        slug = re.sub(r"[^\w\- ]", "", words.strip().lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return out


def links(text: str):
    """(line, target) of each inline link, code blocks and spans left out."""
    for tok in _MD.parse(text):
        for child in tok.children or []:
            if child.type == "link_open":
                yield tok.map[0] + 1, child.attrs["href"]


def broken(doc: Path, text: str) -> list:
    problems = []
    for line, href in links(text):
        if _EXTERNAL.match(href):
            continue
        path, _, fragment = href.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if path and not target.exists():
            problems.append(f"line {line}: {href}: no file {target}")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target.read_text() if path else text):
            problems.append(f"line {line}: {href}: no heading #{fragment} in {target.name}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_relative_links_resolve(doc: Path):
    problems = broken(doc, doc.read_text())
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_check_catches_a_broken_link():
    doc = ROOT / "README.md"
    text = ("# A `code` heading, with punctuation\n\n# Twice\n\n# Twice\n\n"
            "[ok](#a-code-heading-with-punctuation) [ok](#twice-1) [ok](docs/api.md) [web](https://example.com)\n"
            "[gone](docs/no_such_page.md) [gone](#twice-2) [gone](docs/api.md#no-such-heading)\n")
    problems = broken(doc, text)
    assert len(problems) == 3 and all("gone" not in p for p in problems), problems
    assert "no_such_page" in problems[0] and "#twice-2" in problems[1] and "no-such-heading" in problems[2]


def stray_markers(text: str) -> list:
    """Lines that open a list with '+' or '*' (the docs' bullets are '-'): a
    wrapped sentence that starts with one ('ASan\\n+ UBSan') renders as a
    one-item list cut out of its paragraph. Code blocks left out."""
    lines = text.splitlines()
    return [tok.map[0] + 1 for tok in _MD.parse(text)
            if tok.type == "bullet_list_open" and lines[tok.map[0]].lstrip()[:1] in "+*"]


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_no_wrapped_line_opens_a_list(doc: Path):
    assert not stray_markers(doc.read_text()), f"{doc.relative_to(ROOT)}: lines {stray_markers(doc.read_text())}"


def test_the_check_catches_a_wrapped_plus():
    assert stray_markers("runs it under ASan\n+ UBSan, and more.\n\n```\n+ code\n```\n- a real bullet\n") == [2]
