"""When a peer jumps to a resuming neighbour's round (peer/links.py `catch_up_round`).

A jump takes every live edge of the jumping peer down. Where peers that are not partners are
legitimately a few rounds apart (a graph that changes every round), each of those edges' resumes
made another peer jump: hundreds of jumps a kill in the churn soak. A peer with a live edge that
is at most `WAITED_GAP` rounds behind now stays where it is and the neighbour waits for it at the
resume round; a peer further behind, or with no live edge, still jumps."""

from __future__ import annotations

import pytest

from gossipcomp.peer.links import RESUME_MARGIN, WAITED_GAP, LinkMonitor, RoundPace

ROUND = 40


def _behind(gap: int, live_edge: bool, exchanged: bool = True) -> LinkMonitor:
    """Peer 1 at ROUND, greeted by neighbour 2 (not alone) at ROUND + gap; its edge to 0 is up
    (`live_edge`) or down, and has carried an exchange (`exchanged`) or never. Every claimed
    round is plausible here (a very fast pace)."""
    monitor = LinkMonitor(1, [0, 2], pace=RoundPace(floor=1e-9))
    if not live_edge:
        monitor.mark_down(0, ROUND, "test: no live edge")
    elif exchanged:
        monitor.in_step([0], ROUND - 1)
    monitor.mark_down(2, ROUND, "test: lost")
    answer = monitor.answer_hello(2, ROUND + gap, 0, False, ROUND)
    assert answer.resume_round == ROUND + gap + RESUME_MARGIN  # the later end's round + margin
    return monitor


@pytest.mark.parametrize("gap", [1, 3, WAITED_GAP])
def test_a_peer_with_a_live_edge_a_few_rounds_behind_waits_instead_of_jumping(gap):
    monitor = _behind(gap, live_edge=True)
    assert monitor.catch_up_round(ROUND) is None
    assert monitor.live() == [0]  # nothing taken down


@pytest.mark.parametrize("gap", [WAITED_GAP + 1, 50])
def test_a_peer_with_a_live_edge_far_behind_still_jumps(gap):
    assert _behind(gap, live_edge=True).catch_up_round(ROUND) == ROUND + gap


@pytest.mark.parametrize("gap", [1, 3, 50])
def test_a_peer_with_no_live_edge_jumps_however_small_the_gap(gap):
    assert _behind(gap, live_edge=False).catch_up_round(ROUND) == ROUND + gap


@pytest.mark.parametrize("gap", [1, WAITED_GAP])
def test_a_peer_whose_up_edge_never_exchanged_jumps(gap):
    """A joiner's edges are up from the start but carry nothing before its admission: they
    keep nobody's round, so it jumps to its neighbours' (it waited outside for good when they
    counted as live: a process joining a live ring never started its rounds)."""
    assert _behind(gap, live_edge=True, exchanged=False).catch_up_round(ROUND) == ROUND + gap


def test_a_peer_that_waited_reaches_the_resume_round_by_its_own_rounds():
    """The peer that did not jump goes on round by round; it never skips past the agreed resume
    round, and at every round before it nothing asks it to move."""
    gap = 3
    monitor = _behind(gap, live_edge=True)
    for round in range(ROUND, ROUND + gap + RESUME_MARGIN):
        assert monitor.catch_up_round(round) is None
    assert monitor.resuming_at(ROUND + gap + RESUME_MARGIN) == [2]
