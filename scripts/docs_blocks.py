"""The fenced code blocks of README.md, docs/*.md and docs/guides/*.md, and who runs each one.

Every block is covered somewhere: tests/test_docs_code_blocks.py runs the Python blocks and the
cheap single-process commands, and fails on a block that nobody covers; what needs several
processes (peers, a coordinator, torchrun) or minutes of training is run by
scripts/check_docs_commands.py, a documented check run by hand. A Python block that only that
check runs says so in its first line: MARKER.

    python scripts/docs_blocks.py            # every block: file, line, language, who runs it
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "# docs-check: several processes"  # first line of a Python block the suite cannot run
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and its text (without the fences)."""

    file: str  # relative to the repository root
    line: int  # of the opening fence, counted from 1
    language: str
    text: str

    @property
    def commands(self) -> list[str]:
        """Shell commands, continuation lines joined; comment lines and blank lines left out."""
        joined = re.sub(r"\\\n\s*", " ", self.text)
        return [c.strip() for c in joined.splitlines() if c.strip() and not c.startswith("#")]


def doc_files() -> list[Path]:
    """The README, then docs/*.md, then the guides (docs/guides/*.md), each group by name."""
    docs = ROOT / "docs"
    return [ROOT / "README.md", *sorted(docs.glob("*.md")), *sorted(docs.glob("guides/*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order."""
    found: list[Block] = []
    language: str | None = None
    start, lines = 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if language is None and fence:
            language, start, lines = fence[1], number, []
        elif language is not None and line.rstrip() == "```":
            found.append(Block(str(path.relative_to(ROOT)), start, language, "\n".join(lines)))
            language = None
        elif language is not None:
            lines.append(line)
    return found


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks(path)]


# Bash blocks, by a phrase of their text, that the suite covers elsewhere or that are no commands
_ELSEWHERE = {
    "--member-timeout 60": "tests/test_membership_cli.py runs a live join with processes (a "
    "live ring of capacity 3 on free ports, fewer rounds)",
    "pip install -e '.[dev]' -c constraints.txt": "install: .ci/run runs the test line verbatim "
    "in a new virtual environment (tests/test_docs_code_blocks.py checks it is the README's)",
    "gossipcomp simulate [--topology": "synopsis: tests/test_docs_code_blocks.py checks every "
    "flag it names against the parsers",
    "> secure-ring4.yaml": "tests/test_tls.py runs this block (fewer rounds, free ports)",
    "--rank 4 --join": "tests/test_torchrun_membership.py runs this live join under torchrun's "
    "c10d rendezvous (free ports, a member leaving too)",
}
_CHEAP = ("gossipcomp topology show", "gossipcomp --help", "python -c 'import gossipcomp")


def coverage(block: Block) -> str:
    """Who runs `block`: 'suite', 'check' (scripts/check_docs_commands.py), a sentence naming
    the test that covers it, or 'not a command' (a YAML schema, a diagram)."""
    if block.language == "python":
        return "check" if block.text.startswith(MARKER) else "suite"
    if block.language != "bash":
        return "not a command"
    for phrase, who in _ELSEWHERE.items():
        if phrase in block.text:
            return who
    if block.file == "docs/benchmarks.md":
        return "benchmark: its full run is the one the page reports; tests/test_*benchmark*.py run each tiny"
    if all(command.startswith(_CHEAP) for command in block.commands):
        return "suite"
    return "check"


def main() -> int:
    for block in all_blocks():
        print(f"{block.file}:{block.line}\t{block.language or '-'}\t{coverage(block)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
