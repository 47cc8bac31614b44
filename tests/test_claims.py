"""One bound for claimed rounds (transport/claims.py): by time since a round known for sure, and
by the agreement of several parties; the Hello (links.py) and the coordinator's reports use it."""

from __future__ import annotations

import pytest

from gossipcomp.transport.base import MAX_WIRE_ROUND
from gossipcomp.transport.claims import (
    RoundClaims,
    agreed_round,
    furthest_round,
    lead_bound,
    quorum_of,
)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_time_bounds_a_claim_and_nothing_overflows():
    assert furthest_round(10, 1.0, 0.01, margin=5, allowance=2.0) == 10 + 5 + 200
    assert furthest_round(10, -3.0, 0.01) == 10  # a clock that went back allows nothing
    assert furthest_round(10, float("nan"), 0.01) == 10
    assert furthest_round(10, float("inf"), 0.01) == MAX_WIRE_ROUND
    assert furthest_round(MAX_WIRE_ROUND, 1e9, 1e-9, margin=10**18) == MAX_WIRE_ROUND
    with pytest.raises(ValueError, match="seconds_per_round"):
        furthest_round(0, 1.0, 0.0)


def test_a_quorum_decides_and_one_liar_moves_nothing():
    assert agreed_round([], 1) is None
    assert agreed_round([7], quorum_of(1)) == 7
    assert agreed_round([100, 2**53 - 1001, 98], quorum_of(3)) == 100
    assert agreed_round([5, 9], 3) is None
    with pytest.raises(ValueError, match="quorum"):
        agreed_round([1], 0)


def test_each_party_is_believed_only_as_far_as_time_allows_since_its_last_claim():
    clock = _Clock()
    claims = RoundClaims(seconds_per_round=0.01, margin=20, clock=clock)
    assert claims.bound("a") is None  # nothing known yet
    assert claims.believe("a", 100).round == 100
    assert claims.believe("b", 104).round == 104
    clock.now += 1.0  # 200 rounds at twice the fastest pace, plus the margin
    liar = claims.believe("a", 2**53 - 1001)
    assert liar.cut and liar.round == 100 + 20 + 200
    assert claims.agreed() == 104  # the liar alone does not move the agreed round
    # a party never heard before is bounded from the round a quorum agreed on, from when a
    # quorum had claimed it (the liar's claim, just now)
    newcomer = claims.believe("c", 2**53 - 1)
    assert newcomer.cut and newcomer.round == 104 + 20
    assert claims.believe("a", 130) == claims.believed("a")  # honest claims come back in
    assert not claims.believed("a").cut and claims.believed("a").round == 130


def test_a_claim_about_the_future_is_bounded_by_a_lead_past_a_known_round():
    assert lead_bound(100, 64) == 164
    assert lead_bound(-5, 3) == 3  # a known round is never below 0
    assert lead_bound(MAX_WIRE_ROUND - 1, 64) == MAX_WIRE_ROUND  # never past what the wire holds
    with pytest.raises(ValueError, match="lead"):
        lead_bound(0, -1)


def test_level_notices_are_held_to_the_lead_bound():
    """The one bound for claimed rounds also bounds a level notice's effective round, from its
    envelope's round: exactly the lead is taken, one past it refused, near the end of the wire's
    range too (schedules: tests/test_schedule_agreement.py, far schedules refused)."""
    from gossipcomp.levels.notices import check_notice
    from gossipcomp.proto.v1 import gossip_pb2 as pb
    from gossipcomp.transport.base import EnvelopeRejected, NoticeRules

    rules = NoticeRules(frozenset({1, 2}), 64)
    for round in (10, MAX_WIRE_ROUND - 70):
        header = pb.EnvelopeHeader(sender=0, round=round)
        header.level_notice.level = 1
        header.level_notice.effective_round = lead_bound(round, 64)
        check_notice(header, 1, rules)  # exactly the lead: taken
        header.level_notice.effective_round = lead_bound(round, 64) + 1
        with pytest.raises(EnvelopeRejected, match="at most 64"):
            check_notice(header, 1, rules)
