"""Every relative link in README.md, CHANGELOG.md and docs/*.md points at a file of the tree,
and a link's #anchor at a heading of the file it names (GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
# [text](target) outside code; an image's ![alt](target) is a link too.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")


def _links(text: str) -> list[str]:
    return _LINK.findall(_CODE.sub("", _FENCE.sub("", text)))


def _anchors(text: str) -> set[str]:
    """GitHub's ids: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    ids = set()
    for heading in re.findall(r"^#+\s+(.*?)\s*$", _FENCE.sub("", text), re.M):
        ids.add(re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-"))
    return ids


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


def test_link_finder_sees_links():
    text = "a [x](docs/a.md#b) `[not](code)` ![img](p.png)\n```\n[no](fence)\n```\n"
    assert _links(text) == ["docs/a.md#b", "p.png"]
    assert _anchors("## How a request flows\n### `LLM` (offline)\n") == {
        "how-a-request-flows", "llm-offline"}
