"""Spec strings: canonical round trips, parameter types and the errors that name what is wrong."""

from __future__ import annotations

import pytest

from gossipcomp.compress import COMPRESSORS, ErrorFeedback, parse_spec
from gossipcomp.compress.quantize import QSGD
from gossipcomp.compress.sparse import RandomK, TopK

SPECS = [
    *COMPRESSORS,
    "topk:ratio=0.05",
    "randomk:ratio=0.1,unbiased=true",
    "qsgd:levels=3",
    "dgc:ratio=0.01",
    "ef+sign",
    "ef+topk:ratio=0.2",
]


@pytest.mark.parametrize("spec", SPECS)
def test_canonical_spec_round_trips(spec: str) -> None:
    compressor = parse_spec(spec)
    again = parse_spec(compressor.spec)
    assert again.spec == compressor.spec
    if not isinstance(compressor, ErrorFeedback):
        assert again == compressor
        assert compressor.name in COMPRESSORS and compressor.codec == compressor.name


def test_values_take_the_declared_types() -> None:
    assert parse_spec("topk:ratio=0.05") == TopK(ratio=0.05)
    assert parse_spec(" randomk : unbiased = TRUE , ratio = 0.1 ") == RandomK(
        ratio=0.1, unbiased=True
    )
    assert parse_spec("randomk:unbiased=true,ratio=0.1").spec == "randomk:ratio=0.1,unbiased=true"
    assert parse_spec("qsgd:levels=3") == QSGD(levels=3)
    assert parse_spec("qsgd").spec == "qsgd:levels=16"
    assert parse_spec("sign").spec == "sign" and parse_spec("sign:").spec == "sign"
    assert parse_spec("topk:ratio=1").spec == "topk:ratio=1.0"


def test_error_feedback_prefix() -> None:
    ef = parse_spec("ef+topk:ratio=0.2")
    assert isinstance(ef, ErrorFeedback) and ef.inner == TopK(ratio=0.2)
    assert ef.spec == "ef+topk:ratio=0.2" and ef.name == "ef+topk" and not ef.unbiased
    with pytest.raises(ValueError, match="cannot wrap error feedback"):
        parse_spec("ef+ef+sign")


def test_unknown_name_lists_every_compressor() -> None:
    with pytest.raises(ValueError, match="unknown compressor 'topq'") as caught:
        parse_spec("topq:ratio=0.1")
    for name in COMPRESSORS:
        assert name in str(caught.value)


def test_unknown_parameter_lists_the_parameters_with_defaults() -> None:
    with pytest.raises(
        ValueError, match="'topk' has no parameter 'rate'; its parameters: ratio=0.01"
    ):
        parse_spec("topk:rate=0.1")
    with pytest.raises(ValueError, match="ratio=0.01, unbiased=false"):
        parse_spec("randomk:k=3")
    with pytest.raises(ValueError, match="its parameters: none"):
        parse_spec("sign:scale=2")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("topk:ratio=0", r"ratio must be in \(0, 1\], got 0.0"),
        ("topk:ratio=1.5", r"ratio must be in \(0, 1\]"),
        ("randomk:ratio=-0.1", r"ratio must be in \(0, 1\]"),
        ("dgc:ratio=nan", r"ratio must be in \(0, 1\]"),
        ("qsgd:levels=0", "levels must be in 1..127, got 0"),
        ("qsgd:levels=128", "levels must be in 1..127"),
        ("qsgd:levels=2.5", "levels: expected int, got '2.5'"),
        ("topk:ratio=abc", "ratio: expected float, got 'abc'"),
        ("randomk:unbiased=yes", "unbiased: expected bool, got 'yes'"),
        ("topk:ratio", "expected key=value, got 'ratio'"),
        ("topk:ratio=0.1,ratio=0.2", "'ratio' given twice"),
    ],
)
def test_bad_values_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)
