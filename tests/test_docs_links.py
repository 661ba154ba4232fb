"""Every relative link in README.md and docs/ points at a file that exists and, with a #fragment, at a heading that
page has (GitHub's anchor rule: lower-cased, punctuation dropped, spaces to hyphens)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The page without its fenced blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchor(heading: str) -> str:
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for line in re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = anchor(m.group(1))
            name, n = base, 1
            while name in found:  # a repeated heading gets -1, -2, ...
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return found


def links(page: pathlib.Path) -> list[str]:
    return [a or b for a, b in LINK.findall(prose(page.read_text()))]


def broken(page: pathlib.Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading #{fragment} in {dest.name}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_the_readme_links_every_user_page():
    targets = {t.partition("#")[0] for t in links(ROOT / "README.md")}
    for name in ("quickstart", "serving", "models", "formats", "performance", "design", "kv_file_format",
                 "block_store"):
        assert f"docs/{name}.md" in targets, name


def test_a_broken_link_and_a_missing_anchor_are_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `int4` format, v1\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-int4-format-v1) [gone](missing.md) [bad](other.md#nope) "
                    "`[code](missing.md)` [web](https://example.com/x)\n\n```\n[fenced](missing.md)\n```\n")
    assert broken(page) == ["missing.md: no such file", "other.md#nope: no heading #nope in other.md"]
