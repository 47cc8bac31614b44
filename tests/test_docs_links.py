"""Every relative link of README.md and docs/**/*.md names a file or folder that exists.

The manual lives in docs/guides/ and the README links to it; a guide renamed or moved, or a
link mistyped, would leave a newcomer at a dead end. Links to the web and to anchors on the
same page are not checked; a link's own anchor (`file.md#part`) is cut before the file is
looked up. Code (fenced blocks and `inline code`) is left out, since `a[i](x)` there is no link.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCED = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_EXTERNAL = ("http://", "https://", "mailto:", "#")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def broken_links(path: Path) -> list[str]:
    """The relative link targets of one Markdown file that name nothing on disk."""
    text = _INLINE_CODE.sub("", _FENCED.sub("", path.read_text()))
    broken = []
    for target in _LINK.findall(text):
        if target.startswith(_EXTERNAL):
            continue
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(target)
    return broken


def test_every_relative_link_names_an_existing_file():
    files = markdown_files()
    assert ROOT / "README.md" in files and any("guides" in p.parts for p in files)
    broken = {str(p.relative_to(ROOT)): broken_links(p) for p in files}
    assert not {name: links for name, links in broken.items() if links}


def test_the_readme_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / target.split("#", 1)[0]).resolve() for target in _LINK.findall(readme)}
    guides = sorted((ROOT / "docs" / "guides").glob("*.md"))
    assert guides
    assert [g.name for g in guides if g.resolve() not in linked] == []


def test_the_checker_finds_a_broken_link_and_ignores_code_and_the_web(tmp_path):
    (tmp_path / "there.md").write_text("x\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok too](there.md#part) [web](https://example.org/x) [anchor](#top)\n"
        "[gone](missing.md#part) and `[code](nowhere.md)`\n"
        "```python\nparts[rank](nowhere_either.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md#part"]
