"""YAML files an operator points gossipcomp at (topologies, allowlists), refused before they
are expanded.

The file itself is read by gossipcomp.inputs.files (regular files only, size checked first, UTF-8);
here its YAML is parsed without aliases or anchors (a 430-byte "billion laughs" expands to
gigabytes), at most MAX_YAML_DEPTH deep (checked by the composer below before it recurses into a
node; libyaml's own limit of 1000 levels, which its look-ahead can reach first in a flow
collection, gives a clean error too) and MAX_YAML_NODES nodes, mapping keys scalars and unique.
Every error names the file, the problem and what was expected, and quotes at most a few dozen
characters of the file.
"""

from __future__ import annotations

import os
from typing import Any

import yaml
from yaml.composer import Composer, ComposerError
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.resolver import Resolver

from gossipcomp.inputs.files import read_text_file
from gossipcomp.inputs.text import QUOTE_LIMIT, quoted

MAX_YAML_BYTES = 16 * 2**20  # a topology or allowlist file; real ones are a few kB
MAX_YAML_DEPTH = 32  # nesting levels; a topology needs 4
MAX_YAML_NODES = 500_000  # ~0.5 KB of parser memory each: bounds memory to a few hundred MB

_MERGE_TAG = "tag:yaml.org,2002:merge"


def _cut(text: str) -> str:
    """A message from the YAML library, which may quote the file, cut to a bounded length."""
    limit = 3 * QUOTE_LIMIT
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


class _Checks(Composer):
    """Composition and construction steps that refuse what operator files never need: aliases
    and anchors, deep nesting, huge documents, non-scalar, merge or duplicate keys."""

    _depth = 0
    _nodes = 0

    def compose_node(self, parent: Node | None, index: object) -> Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ComposerError(
                None, None, "aliases and anchors (*name, &name) are not allowed", event.start_mark
            )
        self._nodes += 1
        if self._nodes > MAX_YAML_NODES:
            problem = f"more than {MAX_YAML_NODES} nodes (MAX_YAML_NODES)"
            raise ComposerError(None, None, problem, event.start_mark)
        if self._depth >= MAX_YAML_DEPTH:
            problem = f"nested more than {MAX_YAML_DEPTH} levels deep (MAX_YAML_DEPTH)"
            raise ComposerError(None, None, problem, event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE_TAG:
                kind = "a merge (<<)" if isinstance(key_node, ScalarNode) else f"a {key_node.id}"
                problem = f"a mapping key is {kind}, not a string or number"
                raise ConstructorError(None, None, problem, key_node.start_mark)
            key = self.construct_object(key_node, deep=True)  # type: ignore[attr-defined]
            if key in seen:
                problem = f"duplicate key {quoted(key)}"
                raise ConstructorError(None, None, problem, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _PythonLoader(
    yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, _Checks, SafeConstructor, Resolver
):
    """The checks on PyYAML's pure-Python parser (when libyaml is missing)."""

    def __init__(self, stream: str) -> None:
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)


if yaml.__with_libyaml__:
    from yaml.cyaml import CParser

    class _LibyamlLoader(_Checks, CParser, SafeConstructor, Resolver):  # type: ignore[misc]
        """The checks on libyaml's parser (about 3x faster): libyaml scans and parses, the
        Python composer above it builds nodes, so the checks see every event."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

    _Loader: type[_Checks] = _LibyamlLoader
else:
    _Loader = _PythonLoader


def parse_yaml(text: str, where: str, expected: str) -> Any:
    """Parse one YAML document with the checks above; ValueError "{where}: {problem}; expected
    {expected}" naming the line and column."""
    loader = _Loader(text)  # type: ignore[call-arg]
    try:
        return loader.get_single_data()  # type: ignore[attr-defined]
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        problem = getattr(error, "problem", None) or str(error)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = f"not valid YAML{at}: {_cut(problem)}"
        raise ValueError(f"{where}: {problem}; expected {expected}") from None
    except ValueError as error:  # e.g. an integer of more than 4300 digits
        problem = f"not valid YAML: {_cut(str(error))}"
        raise ValueError(f"{where}: {problem}; expected {expected}") from None
    finally:
        loader.dispose()  # type: ignore[attr-defined]


def load_yaml_file(path: str | os.PathLike[str], what: str, expected: str) -> Any:
    """Read (gossipcomp.inputs.files.read_text_file, at most MAX_YAML_BYTES) and parse (see
    parse_yaml) one YAML file; FileNotFoundError or ValueError "{what} {path}: {problem};
    expected {expected}"."""
    text = read_text_file(path, what, expected, MAX_YAML_BYTES)
    return parse_yaml(text, f"{what} {os.fspath(path)}", expected)
