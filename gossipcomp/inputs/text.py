"""Quoting values that came from outside (the network, a file) inside error messages.

An error names what was wrong, but never echoes unbounded input: a 16 MiB phase string or a
million-entry shape would make the error itself the attack.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

QUOTE_LIMIT = 80  # characters of a quoted value kept in an error message


def quoted(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """repr(value), cut to `limit` characters (with '...' and the full length when cut)."""
    if isinstance(value, str | bytes) and len(value) > 4 * limit:
        text = repr(value[: 4 * limit])  # never build the repr of a huge string
        total = len(value)
    else:
        text = repr(value)
        total = len(text)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 3]}... ({total} characters)"


def split_top_level(text: str, label: str) -> list[str]:
    """`text` split at the commas outside parentheses, each item stripped, empty ones dropped:
    "a=1,b=(c=2,d=3)" -> ["a=1", "b=(c=2,d=3)"]. A spec nests another spec in parentheses;
    ValueError, beginning with `label`, when they do not balance."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{label}: a ')' closes no '('")
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"{label}: a '(' is never closed")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def spec_options(text: str, label: str, keys: Collection[str]) -> dict[str, str]:
    """The "key=value,..." part of a spec as {key: raw value}, items split by `split_top_level`:
    every key one of `keys` and given once (a repeated key is refused, never the last one kept);
    ValueError, beginning with `label`, naming the item that is not."""
    values: dict[str, str] = {}
    for item in split_top_level(text, label):
        key, equals, raw = (piece.strip() for piece in item.partition("="))
        if not equals or key not in keys:
            raise ValueError(
                f"{label}: expected key=value with key in {', '.join(keys)}, got {quoted(item)}"
            )
        if key in values:
            raise ValueError(f"{label}: {key} given twice")
        values[key] = raw
    return values
