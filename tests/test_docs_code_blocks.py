"""What README.md, docs/*.md and the guides (docs/guides/*.md) print runs as printed: every
Python block, the cheap commands, the flags of the command synopsis, the install line CI runs;
and the public API they use (`import gossipcomp`, shipped topology names, help text, a
coordinator stopped with `kill`). No block is dropped silently: the blocks each part of the
check covers are counted, and the special blocks must be where they are documented to be.

Blocks that need several processes or minutes of training are run by the documented check
scripts/check_docs_commands.py; scripts/docs_blocks.py says who covers each block, and a block
nobody covers fails here."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from gossipcomp.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("docs_blocks", ROOT / "scripts" / "docs_blocks.py")
assert _spec is not None and _spec.loader is not None
docs_blocks = importlib.util.module_from_spec(_spec)
sys.modules["docs_blocks"] = docs_blocks  # dataclasses look their module up
_spec.loader.exec_module(docs_blocks)

BLOCKS = docs_blocks.all_blocks()
PYTHON = [b for b in BLOCKS if b.language == "python" and docs_blocks.coverage(b) == "suite"]
BASH = [b for b in BLOCKS if b.language == "bash" and docs_blocks.coverage(b) == "suite"]


def _id(block) -> str:
    return f"{block.file}:{block.line}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    """The environment torchrun gives a world of one process, for blocks written for it."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


# At least as many blocks of each kind as when the manual moved from the README to the guides:
# a block that disappears (or stops being read) fails here rather than going unchecked.
FLOOR = {"python suite": 2, "python check": 1, "bash suite": 1, "bash check": 11}
# The blocks checked elsewhere or by a special rule, and the one file each must be in.
HOME = {
    "-c constraints.txt": "README.md",  # the install and test lines: CI runs the second
    "gossipcomp simulate [--topology": "docs/guides/commands.md",  # the synopsis
    "> secure-ring4.yaml": "docs/guides/security.md",  # tests/test_tls.py runs it
    docs_blocks.MARKER: "docs/guides/own-model.md",  # saved as train_peer.py by the check
}


def test_no_block_is_lost_in_the_move_to_the_guides():
    files = {p.relative_to(ROOT).as_posix() for p in docs_blocks.doc_files()}
    guides = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "guides").glob("*.md")}
    assert guides and {"README.md", *guides} <= files  # every guide is read
    counts: dict[str, int] = {}
    for block in BLOCKS:
        if block.file.startswith(("README.md", "docs/guides/")):
            kind = f"{block.language} {docs_blocks.coverage(block)}"
            counts[kind] = counts.get(kind, 0) + 1
    for kind, least in FLOOR.items():
        assert counts.get(kind, 0) >= least, (kind, counts)
    for phrase, home in HOME.items():
        where = [_id(b) for b in BLOCKS if phrase in b.text]
        assert len(where) == 1 and where[0].startswith(f"{home}:"), (phrase, where)


def test_every_block_the_check_script_runs_is_in_a_file_it_reads():
    spec = importlib.util.spec_from_file_location(
        "check_docs", ROOT / "scripts" / "check_docs_commands.py"
    )
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    manual = [b for b in BLOCKS if docs_blocks.coverage(b) == "check"]
    assert manual and all(check._checked_here(b.file) for b in manual), [_id(b) for b in manual]


def test_every_block_is_covered_and_few_need_the_manual_check():
    assert len(PYTHON) >= 2 and BASH, "the README and its guides lost their runnable blocks"
    uncovered = [_id(b) for b in BLOCKS if not docs_blocks.coverage(b)]
    assert not uncovered
    marked = [b for b in BLOCKS if b.language == "python" and b.text.startswith("# docs-check")]
    assert len(marked) <= 2, [_id(b) for b in marked]
    for block in marked:  # a marker is the exact one the check script looks for
        assert block.text.startswith(docs_blocks.MARKER), _id(block)
    assert (ROOT / "scripts" / "check_docs_commands.py").is_file()


def _ran(command: list[str], cwd: Path, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """`command` run in `cwd` with the docs' environment, asserted to have exited 0."""
    result = subprocess.run(
        command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", PYTHON, ids=_id)
def test_python_block_runs_as_printed(block, tmp_path):
    result = _ran([sys.executable, "-c", block.text], tmp_path, timeout=840)
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", result.stdout)]
    assert all(a >= 0.9 for a in accuracies), result.stdout  # the README says 0.96 to 0.97
    losses = re.findall(r"step 0 loss (\d+\.\d+)\n.*step \d+ loss (\d+\.\d+)", result.stdout)
    for first, last in losses:  # the all-reduce block trains
        assert float(last) < 0.5 * float(first), result.stdout
    assert accuracies or losses, f"{_id(block)} printed nothing to check: {result.stdout}"


@pytest.mark.parametrize("block", BASH, ids=_id)
def test_cheap_command_block_runs_as_printed(block, tmp_path):
    result = _ran(["bash", "-euo", "pipefail", "-c", block.text], tmp_path, timeout=300)
    assert result.stdout.strip(), "printed nothing"


def _synopsis() -> dict[tuple[str, ...], set[str]]:
    """The command synopsis (docs/guides/commands.md): each command (`simulate`, `keys new`)
    with its flags."""
    block = next(b for b in BLOCKS if "gossipcomp simulate [--topology" in b.text)
    commands: dict[tuple[str, ...], set[str]] = {}
    current: tuple[str, ...] = ()
    for line in block.text.splitlines():
        if line.startswith("gossipcomp "):
            words = line.split()[1:3]
            current = tuple(words) if words[0] in ("keys", "topology") else (words[0],)
        commands.setdefault(current, set()).update(re.findall(r"--[a-z][a-z-]*", line))
    return commands


def test_every_flag_of_the_synopsis_exists():
    parser = build_parser()
    commands = _synopsis()
    assert len(commands) == 7, sorted(commands)  # simulate ... topology show
    for command, flags in commands.items():
        sub = parser
        for word in command:
            sub = next(
                a for a in sub._actions if a.__class__.__name__ == "_SubParsersAction"
            ).choices[word]
        known = {o for a in sub._actions for o in a.option_strings}
        assert flags <= known, f"gossipcomp {' '.join(command)}: {sorted(flags - known)}"


# ---- the install CI runs is the README's, in a new virtual environment -----------------------


def test_ci_runs_the_readmes_test_line_in_a_new_virtual_environment():
    install = next(b for b in BLOCKS if "-c constraints.txt" in b.text)
    assert install.file == "README.md" and install.line == 3, _id(install)  # its first block
    test_line = next(line for line in install.text.splitlines() if "pytest" in line)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == test_line
    assert any(re.match(r"python3? -m venv ", line) for line in ci)
    assert any(line.startswith("source ") and "/bin/activate" in line for line in ci)


def test_constraints_pin_every_dependency_within_pyproject_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pin = Requirement(line)
            pins[pin.name.lower().replace("_", "-")] = next(iter(pin.specifier)).version
    for text in wanted:
        requirement = Requirement(text)
        name = requirement.name.lower().replace("_", "-")
        if name == "torch":  # installed first by the README, not pinned (constraints.txt)
            continue
        assert name in pins, f"{name} is not in constraints.txt"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]}: {text}"


# ---- the public API the blocks use --------------------------------------------------------


def test_import_gossipcomp_is_light_and_exports_the_api():
    code = (
        "import sys, gossipcomp\n"
        "light = sorted(m for m in ('torch', 'grpc', 'rich') if m in sys.modules)\n"
        "names = [n for n in gossipcomp.__all__ if getattr(gossipcomp, n) is None]\n"
        "print(light, names, 'Peer' in dir(gossipcomp), gossipcomp.Peer.__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[] [] True gossipcomp.peer.node"
    import gossipcomp

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        gossipcomp.nothing  # noqa: B018


def test_load_topology_takes_shipped_names_like_the_command_line(tmp_path, monkeypatch):
    from gossipcomp import TopologyError, load_topology, shipped_topologies

    assert {"ring4", "ring8", "torus16"} <= set(shipped_topologies())
    ring = load_topology("ring4")
    assert ring.n == 4 and ring.addresses[3] == "127.0.0.1:50103"
    monkeypatch.chdir(tmp_path)  # a file of that name wins over the shipped one
    Path("ring4").write_text("kind: complete\nn: 3\n")
    assert load_topology("ring4").n == 3
    with pytest.raises(TopologyError, match="nowhere: no such file, and not a shipped topology"):
        load_topology("nowhere")


def test_help_shows_no_default_for_flags_that_take_no_value(capsys):
    assert main(["peer", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-gossip-buffers keep each peer's own" in text
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "(default: 30.0)" in text or "(default: 30)" in text  # values still show theirs


@pytest.mark.timeout(300)
def test_kill_stops_the_coordinator_cleanly(tmp_path):
    """The README's `kill $coordinator` made it exit 143 (killed by SIGTERM)."""
    command = ["coordinator", "--topology", "ring4", "--address", "127.0.0.1:0"]
    process = subprocess.Popen(
        [sys.executable, "-m", "gossipcomp", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert process.stdout is not None
        seen = ""
        deadline = time.monotonic() + 240
        while "peers join with" not in " ".join(seen.split()) and time.monotonic() < deadline:
            seen += process.stdout.readline()
        assert "peers join with" in " ".join(seen.split()), seen
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, seen + rest
    assert "terminated (SIGTERM); stopped serving" in " ".join(rest.split())
