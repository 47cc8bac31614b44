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


_TEST_REFERENCE = re.compile(r"tests/(test_\w+\.py)((?:(?:::|, ::)\w+)*)")


def missing_tests(text: str) -> list[str]:
    """The `tests/test_x.py::test_name` references in `text` (a file, or a file and its tests,
    `::a, ::b`) whose file or test function does not exist."""
    missing = []
    for match in _TEST_REFERENCE.finditer(text):
        path = ROOT / "tests" / match[1]
        if not path.exists():
            missing.append(match[0])
            continue
        source = path.read_text()
        missing += [
            f"{match[1]}::{name}"
            for name in re.findall(r"::(\w+)", match[2])
            if not re.search(rf"^(?:async )?def {name}\(", source, re.M)
        ]
    return missing


def test_every_test_the_docs_cite_exists():
    """docs/reliability.md and design.md cite the test behind each promise: a test renamed or
    removed must not leave a promise citing nothing."""
    cited = {path.name: missing_tests(path.read_text()) for path in markdown_files()}
    assert not {name: refs for name, refs in cited.items() if refs}
    assert sum(len(_TEST_REFERENCE.findall(p.read_text())) for p in markdown_files()) > 50


def test_the_test_reference_checker_finds_a_renamed_test():
    text = (
        "see tests/test_docs_links.py::test_every_test_the_docs_cite_exists, ::no_such_test "
        "and tests/test_no_such_file.py"
    )
    assert missing_tests(text) == ["test_docs_links.py::no_such_test", "tests/test_no_such_file.py"]
