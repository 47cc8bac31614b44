"""The one range check every door uses for numbers from outside (gossipcomp.inputs.numbers),
each attack a field could carry is refused in the same words, naming the field and the range."""

from __future__ import annotations

import math

import pytest

from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import split_top_level


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, "got True"),  # a bool is not the number 1
        (math.nan, "got nan"),
        (math.inf, "got inf"),
        (-math.inf, "got -inf"),
        ("0.5", "got '0.5'"),  # a string from a file is not parsed here
        (None, "got None"),
        (1.0000001, "got 1.0000001"),
        (0.0, "got 0.0"),  # the open low end
    ],
)
def test_a_number_outside_its_range_or_not_a_number_is_refused_naming_both(value, expected):
    with pytest.raises(ValueError, match=r"^lr: expected a finite number in \(0, 1\], ") as error:
        checked_number("lr", value, 0.0, 1.0, closed_low=False)
    assert str(error.value).endswith(expected)


def test_the_ends_of_a_range_are_open_or_closed_as_told():
    assert checked_number("x", 0, 0.0, 1.0) == 0.0 and isinstance(
        checked_number("x", 1, 0, 1), float
    )
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        checked_number("momentum", 1.0, 0.0, 1.0, closed_high=False)
    assert checked_number("loss", 1e300, 0.0, math.inf, closed_high=False) == 1e300
    with pytest.raises(ValueError, match=r"\[0, inf\), got inf"):
        checked_number("loss", math.inf, 0.0, math.inf, closed_high=False)


def test_an_integer_must_be_an_int_in_range():
    assert checked_integer("round", 7, 0, 7) == 7
    assert checked_integer("bytes", 10**30, 0) == 10**30  # no upper end when none is given
    for value in (False, 1.0, "3", None, 8, -1):
        with pytest.raises(ValueError, match=r"^round: expected an integer in \[0, 7\], got "):
            checked_integer("round", value, 0, 7)
    with pytest.raises(ValueError, match=r"^bytes: expected an integer >= 0, got -1$"):
        checked_integer("bytes", -1, 0)


def test_an_error_never_echoes_unbounded_input():
    with pytest.raises(ValueError) as error:
        checked_number("lr", "9" * 1_000_000, 0.0, 1.0)
    assert len(str(error.value)) < 200 and "1000000 characters" in str(error.value)
    with pytest.raises(ValueError) as error:
        checked_integer("round", [0] * 100_000, 0, 10)
    assert len(str(error.value)) < 200


def test_specs_split_at_top_level_commas_and_unbalanced_parentheses_are_named():
    """The one splitter of nested specs (algorithm specs, DiLoCo's --sync): commas inside
    parentheses belong to the nested spec; a stray parenthesis is named, whichever way."""
    assert split_top_level(" a=1, b=(c=2,d=(e=3,f=4)) ,, g ", "spec") == [
        "a=1",
        "b=(c=2,d=(e=3,f=4))",
        "g",
    ]
    with pytest.raises(ValueError, match=r"^spec: a '\(' is never closed$"):
        split_top_level("a=(b=1,c=2", "spec")
    with pytest.raises(ValueError, match=r"^spec: a '\)' closes no '\('$"):
        split_top_level("a=b=1),(c=2", "spec")
