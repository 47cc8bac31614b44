"""Choco-SGD and DEF-ATC levels set by the senders themselves, without a coordinator
(levels/senders.py).

Each peer decides the level it broadcasts at and announces (level, effective round) to every
neighbour. Shown here: a link that slows tenfold lowers its two ends' levels, which rise again
when it recovers (throttled in-process ring); a very high budget takes every peer to no
compression and a very low one to the lowest level, over the in-process transport and over real
gRPC; after every round both ends of every edge track the same copies bit for bit, every peer
decodes each neighbour at the level that neighbour sends at, nothing fails and Choco's network
sum is kept; a lost notice takes the edge down and the resume tells each end the other's level;
hostile notices are refused at the door naming the field, and a neighbour can set only its
own level; checkpoints keep the levels.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import grpc
import helpers
import pytest
import torch
from conftest import build_network, gossip_round, run_in_threads
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gossipcomp.cli import main
from gossipcomp.compress import parse_spec
from gossipcomp.gossip import DEFATC, Choco
from gossipcomp.gossip.base import RESUME_PHASE
from gossipcomp.levels.edges import MIN_SENDS, NOTICE_LEAD, NoticeConflict
from gossipcomp.levels.notices import MAX_NOTICE_LEAD
from gossipcomp.levels.senders import SenderLevels
from gossipcomp.peer import Peer
from gossipcomp.peer.links import LinkState
from gossipcomp.schedule.costs import LinkCost
from gossipcomp.security import PeerKeys
from gossipcomp.topology import build_topology
from gossipcomp.transport.authentication import Authenticator
from gossipcomp.transport.base import Envelope, EnvelopeRejected, LevelNotice, NoticeRules
from gossipcomp.transport.codec import encode_raw, tensor_spec
from gossipcomp.transport.memory import Fault, InMemoryHub
from gossipcomp.transport.throttled import LinkRates, RateChange
from gossipcomp.transport.wire import content_sha256, header_of

RING4 = build_topology("ring", n=4)
EDGES = ((0, 1), (1, 2), (2, 3), (0, 3))
ALGORITHMS = {
    "choco": lambda: Choco(parse_spec("topk:ratio=0.05")),
    "def": lambda: DEFATC(parse_spec("topk:ratio=0.05")),
}


def _models(algorithm: str, hidden: int = 32) -> list[torch.nn.Module]:
    """Four models: different for Choco; one for DEF-ATC, whose references all start at the
    initial model (its copies agree only when the peers start alike)."""
    return helpers.mlp_models(4, hidden, same=algorithm == "def")


def _assert_ends_agree(peers: Sequence[Peer]) -> None:
    """On every edge up at both ends: each end decodes the other at the level it sends at, and
    tracks its copy bit for bit."""
    for a, b in EDGES:
        if peers[a].links.state(b) is not LinkState.UP or peers[b].links.state(a) is not (
            LinkState.UP
        ):
            continue
        for me, other in ((a, b), (b, a)):
            levels = peers[me].algorithm._levels
            assert levels.levels[other] == peers[other].algorithm._levels.own, (me, other)
            own, _ = helpers.tracked(peers[other])
            for x, y in zip(own, helpers.tracked(peers[me])[1][other], strict=True):
                assert torch.equal(x, y), (me, other)


@pytest.mark.parametrize(
    ("algorithm", "transport", "budget", "where"),
    [
        ("choco", "memory", 1e3, "top"),
        ("choco", "memory", 1e-9, "bottom"),
        ("def", "memory", 1e3, "top"),
        ("def", "memory", 1e-9, "bottom"),
        ("choco", "grpc", 1e3, "top"),
    ],
)
def test_a_very_high_budget_sends_uncompressed_and_a_very_low_one_the_floor_level(
    one_thread, algorithm, transport, budget, where
):
    """Every peer decides once its links have MIN_SENDS timed sends and switches NOTICE_LEAD
    rounds later, its neighbours with it; ends agree after every round, nothing fails and
    Choco's network sum is kept."""
    peers = build_network(RING4, _models(algorithm), ALGORITHMS[algorithm], transport=transport)
    try:
        for peer in peers:
            peer.adapt_levels(budget)
        ladder = peers[0].algorithm._levels.ladder
        # the bottom a controller may choose is the floor (levels/codecs.py), not the ladder's
        # first rung: a top-k ratio of 1e-4 sent ~100 bytes and nothing was learnt
        floor = peers[0].algorithm._levels.floor
        assert 1 < floor < ladder.top
        expected = ladder.top if where == "top" else floor
        before = helpers.network_sum(peers)
        for _ in range(MIN_SENDS + NOTICE_LEAD + 3):
            gossip_round(peers)
            _assert_ends_agree(peers)
        for peer in peers:
            assert peer.algorithm._levels.own == expected
            [change] = peer.stats.peer_levels
            assert change["level"] == ladder.spec(expected)
            # decided as soon as MIN_SENDS sends are timed (one round later over gRPC when a
            # send's timing came too late)
            assert MIN_SENDS + NOTICE_LEAD <= change["round"] <= MIN_SENDS + NOTICE_LEAD + 1
        if where == "top":
            assert ladder.spec(expected) == "identity"
        helpers.assert_clean(peers)
        if algorithm == "choco":
            helpers.assert_sum_kept(before, peers, 1e-4)
    finally:
        helpers.close_all(peers)


def _throttled_ring(rates: LinkRates, algorithm: str, budget: float) -> list[Peer]:
    kind = Choco if algorithm == "choco" else DEFATC
    models = _models(algorithm, hidden=256)
    return helpers.throttled_ring(
        RING4, models, rates, lambda: kind(parse_spec("topk:ratio=0.01")), budget
    )


@pytest.mark.parametrize("algorithm", ["choco", "def"])
def test_a_link_that_slows_tenfold_lowers_its_ends_levels_and_they_rise_when_it_recovers(
    one_thread, algorithm
):
    """ring4 over the throttled transport, every peer deciding its own level every round
    within a 120 ms budget. Link 0-1 drops from 8 to 0.8 Mbit/s at round 24 and recovers at
    round 52: peers 0 and 1 fall to a level whose payload fits the slow link within 12 rounds
    and rise after it; peer 2 (no slow link) stays above. No exchange fails or mismatches,
    both ends track the same copies, and Choco keeps the network sum."""
    budget, rounds, drop, back = 0.12, 72, 24, 52
    rates = LinkRates(8, [RateChange(0, 1, 0.8, drop), RateChange(0, 1, 8, back)])
    peers = _throttled_ring(rates, algorithm, budget)

    def train(peer: Peer) -> None:
        for _ in range(rounds):
            peer.gossip()

    try:
        before = helpers.network_sum(peers)
        run_in_threads([lambda p=p: train(p) for p in peers], 120)
        costs = peers[0].algorithm.level_costs(peers[0].gossiped)
        slow = LinkCost(0.0, 8 / 0.8e6)
        fits_slow = max(x for x in costs.levels if costs.seconds(x, slow) <= budget)
        for rank in (0, 1):
            level = helpers.level_by_round(peers[rank], rounds)
            assert level[drop - 1] > fits_slow, (rank, level, fits_slow)
            assert level[drop + 12] <= fits_slow, (rank, level, fits_slow)
            assert level[rounds] > level[back - 1], (rank, level)
        assert helpers.level_by_round(peers[2], rounds)[drop + 12] > fits_slow
        helpers.assert_clean(peers)
        _assert_ends_agree(peers)
        if algorithm == "choco":
            helpers.assert_sum_kept(before, peers, 1e-3)
    finally:
        helpers.close_all(peers)


def _memory_ring(
    algorithm: str = "choco", adapt: Sequence[int] = range(4)
) -> tuple[list[Peer], InMemoryHub]:
    """ring4 in this process, the peers of `adapt` setting their levels with a budget no link
    can exceed; lost neighbours probed at once (rounds take milliseconds here)."""
    peers, hub = helpers.memory_ring(RING4, _models(algorithm), ALGORITHMS[algorithm])
    for r in adapt:
        peers[r].adapt_levels(1e3)
    return peers, hub


@pytest.mark.parametrize("algorithm", ["choco", "def"])
def test_a_lost_notice_takes_the_edge_down_and_the_resume_tells_each_end_the_others_level(
    one_thread, algorithm
):
    """Every peer decides in round MIN_SENDS, and every message from 0 to 1 is lost in that
    round: the edge fails at both ends, neither hears the other's notice, both switch while it
    is down. At the resume each end states its level and both ends decode each other at it;
    from then on the copies agree and nothing else fails."""
    peers, hub = _memory_ring(algorithm)
    try:
        for peer in peers:
            peer.start(5, {})
        before = helpers.network_sum(peers)
        for r in helpers.gossip_losing_round(peers, hub, MIN_SENDS, 40):
            if r == MIN_SENDS:
                assert 0 not in peers[1]._sender_levels.waiting()
                assert 1 not in peers[0]._sender_levels.waiting()
            _assert_ends_agree(peers)
        top = peers[0].algorithm._levels.ladder.top
        assert peers[0].links.state(1) is LinkState.UP and peers[1].links.state(0) is LinkState.UP
        assert peers[0].algorithm._levels.levels == dict.fromkeys((0, 1, 3), top)
        assert peers[1].algorithm._levels.levels == dict.fromkeys((0, 1, 2), top)
        assert peers[0].stats.failed_exchanges == {1: 1}
        assert peers[1].stats.failed_exchanges == {0: 1}
        assert peers[2].stats.failed_exchanges == peers[3].stats.failed_exchanges == {}
        if algorithm == "choco":
            helpers.assert_sum_kept(before, peers, 1e-4)
    finally:
        helpers.close_all(peers)


def test_an_edge_resuming_while_notices_wait_hears_them_in_the_levels_exchange(one_thread):
    """Edge 0-1 is lost in round 0 and resumes before the notices its ends decide in round
    MIN_SENDS take effect: the resume states the levels in force and the levels exchange after
    it carries the waiting notices, so both ends switch at their round with no further
    failure."""
    peers, hub = _memory_ring()
    try:
        for peer in peers:
            peer.start(5, {})
        hub.inject(0, 1, Fault.LOST)
        gossip_round(peers)
        hub.heal()
        resumed = None
        for _ in range(16):
            gossip_round(peers)
            _assert_ends_agree(peers)
            if resumed is None and peers[0].links.state(1) is LinkState.UP:
                resumed = peers[0].round - 1
                assert peers[0]._sender_levels.waiting()[1] == peers[1]._sender_levels.own_notice
                assert peers[1]._sender_levels.waiting()[0] == peers[0]._sender_levels.own_notice
        assert resumed is not None and resumed < MIN_SENDS + NOTICE_LEAD, resumed
        top = peers[0].algorithm._levels.ladder.top
        for rank in (0, 1):
            [change] = peers[rank].stats.peer_levels
            assert change == {"round": MIN_SENDS + NOTICE_LEAD, "level": "identity"}
            assert set(peers[rank].algorithm._levels.levels.values()) == {top}
        assert peers[0].stats.failed_exchanges == {1: 1}
        assert peers[1].stats.failed_exchanges == {0: 1}
    finally:
        helpers.close_all(peers)


def test_a_neighbour_sets_only_its_own_level_and_a_lie_costs_it_that_edge(one_thread):
    """Peer 0 does not adapt and announces by hand to peer 1: the lowest level a controller
    may choose (the floor) from round 3. Peer 1 takes it for peer 0's level only (its own and
    peer 2's keep theirs); peer 0 does not switch, so edge 0-1 fails at round 3 while edge 1-2
    never does."""
    peers, _ = _memory_ring(adapt=(1, 2, 3))
    try:
        for peer in peers:
            peer.start(5, {})
        low = peers[1].algorithm._levels.floor
        default = peers[1].algorithm.default_level()
        assert low != default
        peers[0].transport.inbox.announce(1, LevelNotice(low, 3))
        gossip_round(peers)
        assert peers[1]._sender_levels.waiting() == {0: LevelNotice(low, 3)}
        for _ in range(3):
            gossip_round(peers)
        assert peers[1]._sender_levels.in_force == {0: low, 1: default, 2: default}
        assert peers[1].stats.failed_exchanges == {0: 1}
        assert peers[1].links.state(2) is LinkState.UP
        assert peers[2]._sender_levels.in_force[1] == default
        assert peers[1].stats.peer_levels == ()
    finally:
        helpers.close_all(peers)


def test_sender_levels_refuse_a_conflict_a_passed_round_and_a_stranger():
    levels = SenderLevels(1, [0, 2], default=5)
    assert levels.hear(2, LevelNotice(3, 7), 5)  # any neighbour, higher-ranked too
    assert not levels.hear(2, LevelNotice(3, 7), 6)  # a repeat
    with pytest.raises(NoticeConflict, match="still waits"):
        levels.hear(2, LevelNotice(4, 8), 6)
    with pytest.raises(NoticeConflict, match="heard in round"):
        levels.hear(0, LevelNotice(4, 5), 5)
    with pytest.raises(NoticeConflict, match="non-neighbour"):
        levels.hear(3, LevelNotice(4, 9), 5)
    notice = levels.decide(2, 5)
    assert notice == LevelNotice(2, 5 + NOTICE_LEAD) and levels.own_notice == notice
    with pytest.raises(ValueError, match="already waits"):
        levels.decide(1, 6)
    assert levels.due(7) == {2: 3} and levels.in_force == {0: 5, 1: 5, 2: 3}
    assert levels.due(9) == {1: 2} and levels.own == 2
    assert levels.resync(0, 4) and not levels.resync(0, 4)
    assert levels.in_force == {0: 4, 1: 2, 2: 3}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"levels": [[0, 5], [1, 5]], "waiting": []}, "a level for each of peers"),
        ({"levels": [[0, 5], [1, 5], [7, 5]], "waiting": []}, "distinct peers"),
        ({"levels": [[0, 5], [1, 0], [2, 5]], "waiting": []}, "levels in"),
        ({"levels": [[0, 5], [1, 5], [2, 5]], "waiting": [[2, 3, -1]]}, "round"),
        ({"levels": [[0, 5], [1, True], [2, 5]], "waiting": []}, "distinct peers"),
        ({"levels": []}, "expected keys"),
    ],
)
def test_hostile_checkpoint_levels_are_refused_naming_the_part(state, message):
    levels = SenderLevels(1, [0, 2], default=5)
    with pytest.raises(ValueError, match=message):
        levels.load_state_dict(state)
    assert levels.in_force == {0: 5, 1: 5, 2: 5}


def test_levels_set_by_senders_survive_a_checkpoint_and_a_stranger_checkpoint_is_refused(
    one_thread,
):
    """Every peer checkpointed two rounds after its notice (waiting for round 8) and restored
    into fresh peers: all switch at round 8 as announced, with no failure, and ends agree; a
    peer that does not set levels refuses such a checkpoint, and a level off the ladder is
    refused."""
    peers, _ = _memory_ring()
    try:
        for peer in peers:
            peer.start(5, {})
        for _ in range(MIN_SENDS + 2):
            gossip_round(peers)
        states = [peer.state_dict() for peer in peers]
    finally:
        helpers.close_all(peers)
    top = peers[0].algorithm._levels.ladder.top
    assert [3, top, MIN_SENDS + NOTICE_LEAD] in states[0]["broadcast_levels"]["waiting"]
    stranger, _ = _memory_ring(adapt=())
    try:
        with pytest.raises(ValueError, match="does not set levels so"):
            stranger[0].load_state_dict(states[0])
    finally:
        helpers.close_all(stranger)
    restored, _ = _memory_ring()
    try:
        bad = {**states[0], "broadcast_levels": {"levels": [[0, 99], [1, 2], [3, 2]]}}
        bad["broadcast_levels"]["waiting"] = []
        with pytest.raises(ValueError, match="level"):
            restored[0].load_state_dict(bad)
        for peer, state in zip(restored, states, strict=True):
            peer.load_state_dict(state)
        run_in_threads([lambda p=p: p.start(5, {}) for p in restored])
        for _ in range(NOTICE_LEAD):
            gossip_round(restored)
            _assert_ends_agree(restored)
        for peer in restored:
            assert peer.algorithm._levels.own == top
            assert [c["round"] for c in peer.stats.peer_levels] == [MIN_SENDS + NOTICE_LEAD]
        helpers.assert_clean(restored)
    finally:
        helpers.close_all(restored)


# -- hostile notices, over real gRPC ------------------------------------------------------------

SPEC = (tensor_spec("w", torch.zeros(4)),)
OWN = NoticeRules(frozenset({1, 2, 4}), MAX_NOTICE_LEAD, own_levels=True, in_force_phase="resume")


def _envelope(sender: int, phase: str, notice: LevelNotice | None) -> Envelope:
    return Envelope(sender, 10, phase, (encode_raw("w", torch.ones(4)),), notice=notice)


@pytest.mark.parametrize(
    ("phase", "notice", "rules", "code", "field"),
    [
        ("model", LevelNotice(3, 12), OWN, grpc.StatusCode.INVALID_ARGUMENT, "level_notice.level"),
        ("model", LevelNotice(0, 12), OWN, grpc.StatusCode.INVALID_ARGUMENT, "level_notice.level"),
        ("model", LevelNotice(-1, 12), OWN, grpc.StatusCode.INVALID_ARGUMENT, "notice.level"),
        ("model", LevelNotice(2**62, 12), OWN, grpc.StatusCode.INVALID_ARGUMENT, "notice.level"),
        ("model", LevelNotice(2, 10), OWN, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        ("model", LevelNotice(2, 3), OWN, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        ("model", LevelNotice(2, -5), OWN, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        (
            "model",
            LevelNotice(2, 11 + MAX_NOTICE_LEAD),
            OWN,
            grpc.StatusCode.INVALID_ARGUMENT,
            "effective_round",
        ),
        ("model", LevelNotice(2, 2**62), OWN, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        ("resume", LevelNotice(2, 11), OWN, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        ("resume", LevelNotice(2, 9), OWN, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        ("resume", LevelNotice(3, 10), OWN, grpc.StatusCode.INVALID_ARGUMENT, "notice.level"),
        ("model", LevelNotice(2, 12), None, grpc.StatusCode.FAILED_PRECONDITION, "level_notice"),
    ],
)
def test_hostile_notices_of_a_senders_own_level_are_refused_at_the_door(
    grpc_pair, phase, notice, rules, code, field
):
    """Envelopes of round 10 from peer 1 (the higher-ranked end: it may announce its own
    level) to peer 0, which takes ladder {1, 2, 4}. Each hostile notice is refused with its
    status, naming the field, in a short message; nothing is stored. Within the rules (in a
    resume envelope: the level in force at round 10) the same envelope is accepted."""
    receiving, sending = grpc_pair()
    receiving.inbox.expect(phase, SPEC)
    receiving.inbox.open_round(10)
    receiving.inbox.accept_notices(rules)
    helpers.assert_refused_at_the_door(sending, receiving, _envelope(1, phase, notice), code, field)
    receiving.inbox.accept_notices(OWN)
    good = LevelNotice(2, 10 if phase == RESUME_PHASE else 12)
    sending.send(0, _envelope(1, phase, good), deadline=time.monotonic() + 5)
    assert receiving.inbox.mailbox.pending() == 1


def test_a_signed_resume_envelope_covers_the_level_it_states():
    """The level a resume envelope states is part of the signed header: altered, added or
    dropped after signing, the header no longer verifies."""
    private = {r: Ed25519PrivateKey.generate() for r in (0, 1)}
    public = {r: key.public_key() for r, key in private.items()}
    envelope = _envelope(1, RESUME_PHASE, LevelNotice(2, 10))
    header = header_of(envelope)
    Authenticator(1, PeerKeys(private[1], public)).prove_envelope(
        header, 0, content_sha256(envelope)
    )
    Authenticator(0, PeerKeys(private[0], public)).check_envelope(header)
    helpers.assert_notice_is_signed(
        header, lambda: Authenticator(0, PeerKeys(private[0], public)), 4, 11
    )
    unsigned = header_of(_envelope(1, RESUME_PHASE, None))
    Authenticator(1, PeerKeys(private[1], public)).prove_envelope(unsigned, 0, b"\0" * 32)
    Authenticator(0, PeerKeys(private[0], public)).check_envelope(unsigned)  # as signed
    unsigned.level_notice.level, unsigned.level_notice.effective_round = 2, 10
    with pytest.raises(EnvelopeRejected, match="signature"):
        Authenticator(0, PeerKeys(private[0], public)).check_envelope(unsigned)


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algorithm", "follow", "level"),
    [("choco", False, "identity"), ("def", False, "identity"), ("choco", True, "topk:ratio=0.02")],
)
def test_simulate_without_a_coordinator_reports_the_levels_the_senders_set(
    tmp_path, algorithm, follow, level
):
    """`simulate --adaptive --no-coordinator` with a budget no link can exceed: every peer
    goes to one level at the same round, as the report's peer_levels show: no compression
    with `--no-follow-loss`, else the floor (the loss has not fallen fourfold by round 12:
    the configured top-k 0.05 comes down to 0.02)."""
    path = tmp_path / "report.json"
    argv = ["--topology", "ring4", "--algorithm", algorithm, "--compressor", "topk:ratio=0.05"]
    argv += ["--adaptive", "--no-coordinator", "--round-budget", "100"]
    argv += [] if follow else ["--no-follow-loss"]
    argv += ["--rounds", "12", "--workers", "1", "--eval-every", "0"]
    assert main(["simulate", "--quiet", "--report", str(path), *argv]) == 0
    report = json.loads(path.read_text())
    for peer in report["per_peer"]:
        assert peer["peer_levels"] == [{"round": MIN_SENDS + NOTICE_LEAD, "level": level}]
        assert peer["failed_exchanges"] == 0
    assert report["mismatched_epoch_exchanges"] == 0
