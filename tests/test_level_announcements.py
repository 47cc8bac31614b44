"""Link levels set by the peers themselves, without a coordinator (levels/edges.py).

The lower-ranked end of each edge decides and announces (level, effective round) in its
envelopes. Shown here: a link that slows tenfold is lowered within a few rounds and its transfers
fit the budget again, and raised when it recovers (throttled in-process ring); a very high
budget takes every link to no compression and a very low one to the lowest level, over real
gRPC as over the in-process transport; both ends of every live edge are at the same level after
every round, no exchange fails or mismatches and the network sum is kept; a lost announcement
takes the edge down and both ends meet again at the algorithm's own level; every hostile
notice is refused at the door naming the field, and a neighbour can move only its own edge.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from functools import partial

import grpc
import helpers
import pytest
import torch
from conftest import build_network, gossip_round, run_in_threads
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gossipcomp.cli import main
from gossipcomp.gossip import DPSGD, PowerGossip
from gossipcomp.levels.edges import MIN_SENDS, NOTICE_LEAD, EdgeLevels
from gossipcomp.levels.notices import MAX_NOTICE_LEAD
from gossipcomp.levels.rate import DEFAULT_DROP_AT
from gossipcomp.peer import Peer
from gossipcomp.peer.links import LinkState
from gossipcomp.schedule.costs import LinkCost
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.schedule import LinkLevel, Schedule, ScheduleRefused
from gossipcomp.security import PeerKeys
from gossipcomp.topology import build_topology
from gossipcomp.transport.authentication import Authenticator
from gossipcomp.transport.base import Envelope, LevelNotice, NoticeRules
from gossipcomp.transport.codec import encode_raw, tensor_spec
from gossipcomp.transport.memory import InMemoryHub
from gossipcomp.transport.throttled import LinkRates, RateChange
from gossipcomp.transport.wire import content_sha256, header_of

RING4 = build_topology("ring", n=4)
EDGES = ((0, 1), (1, 2), (2, 3), (0, 3))


def _rank(peer: Peer, neighbour: int) -> int:
    return peer.algorithm._link_ranks[neighbour]


def _assert_ends_agree(peers: Sequence[Peer]) -> None:
    """Every edge up at both ends uses one level, and its power vectors are equal."""
    for a, b in EDGES:
        if peers[a].links.state(b) is LinkState.UP and peers[b].links.state(a) is LinkState.UP:
            assert _rank(peers[a], b) == _rank(peers[b], a), (a, b)
            mine, theirs = peers[a].algorithm._state, peers[b].algorithm._state
            for (j, i, side), vector in mine.items():
                if j == b:
                    torch.testing.assert_close(vector, theirs[(a, i, side)], rtol=0, atol=0)


@pytest.mark.parametrize("transport", ["memory", "grpc"])
@pytest.mark.parametrize(("budget", "expected"), [(1e3, "top"), (1e-9, "bottom")])
def test_a_very_high_budget_takes_links_to_the_top_and_a_very_low_one_near_the_lowest(
    one_thread, transport, budget, expected
):
    """PowerGossip at rank 2 on a ring: within a few rounds every link is at the ladder's top
    (no compression), or, for a budget below what any link takes, at most DEFAULT_DROP_AT
    times the lowest level's bytes (rank 1; the budget is then the slowest link's time at the
    lowest level, and a link that carries more in that time costs the round nothing) with
    the slower of peer 0's two edges at rank 1, each edge decided as soon as its sends are
    timed, both ends switching at the same round; nothing fails and the sum is kept."""
    peers = build_network(
        RING4, helpers.mlp_models(4), lambda: PowerGossip(rank=2), transport=transport
    )
    try:
        for peer in peers:
            peer.adapt_levels(budget)
        costs = peers[0].algorithm.level_costs(peers[0].gossiped)
        ladder = costs.levels
        cap = DEFAULT_DROP_AT * costs.bytes_per_round[ladder[0]]
        before = helpers.network_sum(peers)
        for _ in range(MIN_SENDS + NOTICE_LEAD + 4):
            gossip_round(peers)
            _assert_ends_agree(peers)
        for a, b in EDGES:
            assert _rank(peers[a], b) == _rank(peers[b], a)
            ends = [
                [
                    (c["round"], c["level"])
                    for c in peers[r].stats.link_levels
                    if c["link"] == [a, b]
                ]
                for r in (a, b)
            ]
            assert ends[0] == ends[1] and ends[0], ends
            # the first decision as soon as MIN_SENDS sends are timed (a send whose timing
            # came too late over gRPC delays it by a round)
            assert MIN_SENDS + NOTICE_LEAD <= ends[0][0][0] <= MIN_SENDS + NOTICE_LEAD + 2
            if expected == "bottom":
                assert costs.bytes_per_round[_rank(peers[a], b)] <= cap, ends
                continue
            assert _rank(peers[a], b) == ladder[-1] and len(ends[0]) == 1, ends
            assert ends[0][0][1] == f"rank={ladder[-1]}"
        if expected == "bottom":  # peer 0 decides both its edges: the slower one sets the floor
            assert min(_rank(peers[0], 1), _rank(peers[0], 3)) == ladder[0]
        helpers.assert_clean(peers)
        helpers.assert_sum_kept(before, peers, 1e-4)
    finally:
        helpers.close_all(peers)


def test_levels_set_by_peers_follow_each_deciding_ends_training_loss(one_thread, caplog):
    """The budget fits the top, but no edge rises above the rung the deciding (lower) end's
    own loss allows: from the first decision the lowest (the algorithm's own rank 2 comes
    down) while no loss has fallen; then peer 1's falls fourfold and the edge it decides
    (1-2) rises a rung, while peer 3's sixteenfold fall moves nothing (it decides no edge),
    each end switching at the same round, nothing failing; a network that never notes a loss
    is capped by nothing, and each of its peers that decides a level says so once."""
    peers = build_network(RING4, helpers.mlp_models(4), lambda: PowerGossip(rank=2))
    try:
        for peer in peers:
            peer.adapt_levels(1e3)
        ladder = peers[0].algorithm.level_costs(peers[0].gossiped).levels
        later = {1: 4.0, 3: 16.0}  # the falls from round MIN_SENDS + NOTICE_LEAD + 2 on
        for round in range(MIN_SENDS + NOTICE_LEAD + 20):
            for peer in peers:
                fall = later.get(peer.rank, 1.0) if round >= MIN_SENDS + NOTICE_LEAD + 2 else 1.0
                peer.note_training_loss(2.0, 2.0 / fall)
            gossip_round(peers)
            _assert_ends_agree(peers)
            ranks = {(a, b): _rank(peers[a], b) for a, b in EDGES}
            if round < MIN_SENDS + NOTICE_LEAD:  # the first decision's notice still waits
                assert set(ranks.values()) == {2}, (round, ranks)  # the algorithm's own
            else:
                assert ranks[(1, 2)] <= ladder[1], (round, ranks)
                assert {r for e, r in ranks.items() if e != (1, 2)} == {ladder[0]}, (round, ranks)
        assert _rank(peers[1], 2) == ladder[1]
        helpers.assert_clean(peers)
    finally:
        helpers.close_all(peers)
    silent = build_network(RING4, helpers.mlp_models(4), lambda: PowerGossip(rank=2))
    try:
        for peer in silent:
            peer.adapt_levels(1e3)
        with caplog.at_level(logging.WARNING, logger="gossipcomp.peer"):
            for _ in range(MIN_SENDS + NOTICE_LEAD + 1):
                gossip_round(silent)
        assert {_rank(silent[a], b) for a, b in EDGES} == {ladder[-1]}  # the budget alone
        said = [r.getMessage() for r in caplog.records if "not capped by the training" in r.message]
        assert sorted(said) == sorted(
            f"peer {r}: levels not capped by the training loss: none noted (a loop of one's "
            "own calls Peer.note_training_loss after each round); the round budget alone sets "
            "them"
            for r in range(3)  # peer 3 is the higher end of both its edges: it decides none
        )
    finally:
        helpers.close_all(silent)


def test_a_peers_fast_links_fill_the_time_its_slow_link_takes_at_the_lowest_level(one_thread):
    """ring4 over the throttled transport, link 0-1 at 1.6 Mbit/s and the rest at 16, a budget
    below any link's time: each deciding peer's budget is its slowest link's time at the
    lowest level (a round waits for it), so link 0-1 stays at rank 1 while peers 0 and 1 raise
    their fast edges (0-3, 1-2) into that time, never past DEFAULT_DROP_AT times rank 1's
    bytes; ends agree, nothing fails, the sum is kept."""
    rates = LinkRates(16, [RateChange(0, 1, 1.6, 0)])
    peers = helpers.throttled_ring(
        RING4, helpers.mlp_models(4, hidden=256), rates, lambda: PowerGossip(rank=1), 1e-9
    )
    try:
        before = helpers.network_sum(peers)
        run_in_threads([lambda p=p: [p.gossip() for _ in range(30)] for p in peers], 120)
        costs = peers[0].algorithm.level_costs(peers[0].gossiped)
        cap = DEFAULT_DROP_AT * costs.bytes_per_round[costs.levels[0]]
        for a, b in EDGES:
            assert _rank(peers[a], b) == _rank(peers[b], a), (a, b)
            assert costs.bytes_per_round[_rank(peers[a], b)] <= cap, (a, b)
        assert _rank(peers[0], 1) == costs.levels[0]
        assert _rank(peers[0], 3) > costs.levels[0] and _rank(peers[1], 2) > costs.levels[0]
        helpers.assert_clean(peers)
        helpers.assert_sum_kept(before, peers, 1e-3)
    finally:
        helpers.close_all(peers)


def test_a_link_that_slows_tenfold_is_lowered_within_a_few_rounds_and_raised_when_it_recovers(
    one_thread,
):
    """ring4 over the throttled transport, each lower-ranked end deciding every round within a
    60 ms budget. Link 0-1 drops from 16 to 1.6 Mbit/s at round 16 and recovers at round 40:
    its rank falls to one whose transfers fit the slow link within 12 rounds (two decisions,
    each announced 4 rounds ahead) and a round's transfers fit the budget again; after the recovery it rises again. Both ends of every edge
    change levels at the same rounds; no exchange fails or mismatches; the sum is kept."""
    budget, rounds, drop, back = 0.06, 64, 16, 40
    rates = LinkRates(16, [RateChange(0, 1, 1.6, drop), RateChange(0, 1, 16, back)])
    peers = helpers.throttled_ring(
        RING4, helpers.mlp_models(4, hidden=256), rates, lambda: PowerGossip(rank=1), budget
    )
    slow_sends: list[float] = []  # link 0-1's last sends before it recovers

    def train(peer: Peer) -> None:
        for _ in range(rounds):
            peer.gossip()
            if peer.rank == 0 and peer.round == back - 1:
                slow_sends.extend(s for _, s in peer.sends.samples(1)[-2:])

    try:
        before = helpers.network_sum(peers)
        run_in_threads([lambda p=p: train(p) for p in peers], 120)
        costs = peers[0].algorithm.level_costs(peers[0].gossiped)
        fits_slow = max(
            x for x in costs.levels if costs.seconds(x, LinkCost(0.0, 8 / 1.6e6)) <= budget
        )
        for a, b in EDGES:
            ends = [[c for c in peers[r].stats.link_levels if c["link"] == [a, b]] for r in (a, b)]
            assert ends[0] == ends[1], (a, b)
        level = helpers.link_level_by_round(peers[0], (0, 1), rounds)
        assert level[drop - 1] > fits_slow, (level, fits_slow)  # above what the slow link allows
        assert level[drop + 12] <= fits_slow, (level, fits_slow)  # lowered within 12 rounds
        assert level[rounds] > level[back - 1], level  # raised again after the recovery
        # a round's transfers (the mean of a right and a left step) fit the budget again
        assert len(slow_sends) == 2 and sum(slow_sends) / 2 <= budget, slow_sends
        helpers.assert_clean(peers)
        helpers.assert_sum_kept(before, peers, 1e-3)
    finally:
        helpers.close_all(peers)


def _memory_ring(
    models: Sequence[torch.nn.Module], algorithm: type = PowerGossip
) -> tuple[list[Peer], InMemoryHub]:
    """ring4 in this process, PowerGossip at rank 2 (or `algorithm`), lost neighbours probed at
    once (rounds take milliseconds here)."""
    made = partial(PowerGossip, rank=2) if algorithm is PowerGossip else algorithm
    return helpers.memory_ring(RING4, models, made)


def _adapting_ring() -> tuple[list[Peer], InMemoryHub]:
    """_memory_ring's peers all setting their levels within a budget no link can exceed, and
    started."""
    peers, hub = _memory_ring(helpers.mlp_models(4))
    try:
        for peer in peers:
            peer.adapt_levels(1e3)
            peer.start(5, {})
    except BaseException:
        helpers.close_all(peers)
        raise
    return peers, hub


def test_a_lost_announcement_takes_the_edge_down_and_both_ends_resume_at_the_own_level(
    one_thread,
):
    """Peer 0 decides link 0-1's level in round MIN_SENDS (its first decision), and every
    message from 0 to 1 is lost in that round, so peer 1 never hears the notice. The edge fails
    at both ends; peer 0 alone passes the effective round (the edge is down); at the resume
    round both ends go back to rank 2 and the controller raises the link again by a new notice.
    At no round do the two ends of a live edge differ, and the sum is kept."""
    peers, hub = _adapting_ring()
    try:
        before = helpers.network_sum(peers)
        for r in helpers.gossip_losing_round(peers, hub, MIN_SENDS, 40):
            if r == MIN_SENDS:
                assert peers[0]._edge_levels.waiting()[1].level == 32
                assert 0 not in peers[1]._edge_levels.waiting()
            _assert_ends_agree(peers)
        assert peers[1].stats.failed_exchanges == {0: 1}
        assert peers[0].stats.failed_exchanges == {1: 1}
        assert _rank(peers[0], 1) == _rank(peers[1], 0) == 32  # raised again after the resume
        link01 = [
            [(c["round"], c["level"]) for c in peers[r].stats.link_levels if c["link"] == [0, 1]]
            for r in (0, 1)
        ]
        # peer 0 switched alone while the edge was down, then went back at the resume round
        assert link01[0][:2] == [(MIN_SENDS + NOTICE_LEAD, "rank=32"), (link01[0][1][0], "default")]
        assert link01[0][2:] == link01[1]  # from the resume on, the same changes at both ends
        helpers.assert_sum_kept(before, peers, 1e-4)
    finally:
        helpers.close_all(peers)


def test_a_neighbour_moves_only_its_own_edge_and_a_contradiction_costs_it_that_edge(one_thread):
    """Peer 0 does not adapt and announces to peer 1 by hand: rank 4 from 3 rounds ahead. Peer 1
    takes it for edge 0-1 only (its edge to 2 keeps its level and never fails); peer 0 does not
    switch, so edge 0-1 fails at that round and later resumes at rank 2 at both ends. A second,
    contradicting notice while the first waits takes the edge down at once."""
    peers, _ = _memory_ring(helpers.mlp_models(4))
    try:
        for peer in peers[1:]:
            peer.adapt_levels(1e-9)  # the lowest level everywhere peers decide: rank 1
        for peer in peers:
            peer.start(5, {})
        peers[0].transport.inbox.announce(1, LevelNotice(4, 3))
        gossip_round(peers)
        assert peers[1]._edge_levels.waiting() == {0: LevelNotice(4, 3)}
        peers[0].transport.inbox.announce(1, None)
        for _ in range(3):
            gossip_round(peers)
        assert [c["link"] for c in peers[1].stats.link_levels] == [[0, 1]]
        assert peers[1].stats.failed_exchanges == {0: 1}  # the round it took effect alone
        assert peers[1].links.state(2) is LinkState.UP
        for _ in range(12):
            gossip_round(peers)
            _assert_ends_agree(peers)
        assert _rank(peers[0], 1) == _rank(peers[1], 0) == 2  # back to the algorithm's own
        assert peers[1].stats.failed_exchanges[0] == 1 and 2 not in peers[1].stats.failed_exchanges

        r = peers[0].round
        peers[0].transport.inbox.announce(1, LevelNotice(4, r + 3))
        gossip_round(peers)
        peers[0].transport.inbox.announce(1, LevelNotice(1, r + 4))
        gossip_round(peers)
        assert peers[1].links.state(0) is not LinkState.UP  # contradicted: edge taken down
        assert peers[1]._edge_levels.waiting() == {0: LevelNotice(4, r + 3)}
    finally:
        helpers.close_all(peers)


def test_levels_come_from_a_coordinator_or_from_the_peers_never_both():
    peers, _ = _memory_ring(helpers.mlp_models(4))
    try:
        peers[1].adapt_levels()
        schedule = Schedule(1, 3, links=(LinkLevel(0, 1, 4),), budget_s=0.1)
        with pytest.raises(ScheduleRefused, match="sets its links' levels with its neighbours"):
            peers[1].apply(schedule)
        peers[2].apply(schedule)
        with pytest.raises(ValueError, match="holds a schedule with link levels"):
            peers[2].adapt_levels()
    finally:
        helpers.close_all(peers)
    plain, _ = _memory_ring(helpers.mlp_models(4), DPSGD)
    try:
        with pytest.raises(ValueError, match="no level per link"):
            plain[0].adapt_levels()
    finally:
        helpers.close_all(plain)


def test_levels_set_by_peers_survive_a_checkpoint_and_a_stranger_checkpoint_is_refused():
    peers, _ = _adapting_ring()
    try:
        for _ in range(MIN_SENDS + 2):
            gossip_round(peers)
        state = peers[0].state_dict()
        assert state["link_levels"]["waiting"] == [
            [1, 32, MIN_SENDS + NOTICE_LEAD],
            [3, 32, MIN_SENDS + NOTICE_LEAD],
        ]
        fresh, _ = _memory_ring(helpers.mlp_models(4))
        try:
            fresh[0].adapt_levels(1e3)
            fresh[0].load_state_dict(state)
            assert fresh[0]._edge_levels.waiting() == peers[0]._edge_levels.waiting()
            with pytest.raises(ValueError, match="does not set levels so"):
                fresh[2].load_state_dict(peers[2].state_dict())
            fresh[1].adapt_levels(1e3)
            bad = peers[1].state_dict()
            bad["link_levels"] = {"in_force": [[5, 2]], "waiting": []}
            with pytest.raises(ValueError, match="distinct neighbours"):
                fresh[1].load_state_dict(bad)
        finally:
            helpers.close_all(fresh)
    finally:
        helpers.close_all(peers)


# -- hostile notices, over real gRPC ------------------------------------------------------------

SPEC = (tensor_spec("w", torch.zeros(4)),)


def _envelope(sender: int, round: int, notice: LevelNotice | None) -> Envelope:
    return Envelope(sender, round, "model", (encode_raw("w", torch.ones(4)),), notice=notice)


@pytest.mark.parametrize(
    ("sender", "notice", "takes", "code", "field"),
    [
        (1, LevelNotice(2, 12), True, grpc.StatusCode.PERMISSION_DENIED, "higher-ranked end"),
        (0, LevelNotice(3, 12), True, grpc.StatusCode.INVALID_ARGUMENT, "level_notice.level"),
        (0, LevelNotice(0, 12), True, grpc.StatusCode.INVALID_ARGUMENT, "level_notice.level"),
        (0, LevelNotice(-1, 12), True, grpc.StatusCode.INVALID_ARGUMENT, "level_notice.level"),
        (0, LevelNotice(2**62, 12), True, grpc.StatusCode.INVALID_ARGUMENT, "level_notice.level"),
        (0, LevelNotice(2, 10), True, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        (0, LevelNotice(2, 3), True, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        (0, LevelNotice(2, -5), True, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        (
            0,
            LevelNotice(2, 11 + MAX_NOTICE_LEAD),
            True,
            grpc.StatusCode.INVALID_ARGUMENT,
            "effective_round",
        ),
        (0, LevelNotice(2, 2**62), True, grpc.StatusCode.INVALID_ARGUMENT, "effective_round"),
        (0, LevelNotice(2, 12), False, grpc.StatusCode.FAILED_PRECONDITION, "level_notice"),
    ],
)
def test_hostile_notices_are_refused_at_the_door_naming_the_field(
    grpc_pair, sender, notice, takes, code, field
):
    """Envelopes of round 10 on an edge of peers 0 and 1; the receiver takes ladder {1, 2, 4}.
    Each notice is refused with its status, naming the field, in a short message; nothing is
    stored. The same envelope without the notice is accepted."""
    zero, one = grpc_pair()
    sending, receiving = (zero, one) if sender == 0 else (one, zero)
    receiving.inbox.expect("model", SPEC)
    receiving.inbox.open_round(10)
    if takes:
        receiving.inbox.accept_notices(NoticeRules(frozenset({1, 2, 4}), MAX_NOTICE_LEAD))
    helpers.assert_refused_at_the_door(
        sending, receiving, _envelope(sender, 10, notice), code, field
    )
    sending.send(receiving.rank, _envelope(sender, 10, None), deadline=time.monotonic() + 5.0)
    assert receiving.inbox.mailbox.pending() == 1


def test_the_notice_travels_to_the_receiver_and_its_signature_covers_it():
    """A notice within the rules reaches the receiver's envelope; a signed header whose notice
    is altered after signing no longer verifies."""
    private = {r: Ed25519PrivateKey.generate() for r in (0, 1)}
    public = {r: key.public_key() for r, key in private.items()}
    signer = Authenticator(0, PeerKeys(private[0], public))
    checker = Authenticator(1, PeerKeys(private[1], public))
    envelope = _envelope(0, 10, LevelNotice(4, 14))
    header = header_of(envelope)
    signer.prove_envelope(header, 1, content_sha256(envelope))
    checker.check_envelope(header)  # as signed: accepted
    helpers.assert_notice_is_signed(
        header, lambda: Authenticator(1, PeerKeys(private[1], public)), 2, 15
    )


def test_edge_levels_refuse_a_notice_from_the_wrong_end_or_for_a_passed_round():
    levels = EdgeLevels(1, [0, 2])
    assert levels.hear(0, LevelNotice(4, 7), 5)
    assert not levels.hear(0, LevelNotice(4, 7), 6)  # a repeat
    with pytest.raises(ValueError, match="not a lower-ranked neighbour"):
        levels.hear(2, LevelNotice(4, 9), 5)
    with pytest.raises(ValueError, match="heard in round"):
        EdgeLevels(1, [0, 2]).hear(0, LevelNotice(4, 5), 5)
    with pytest.raises(ValueError, match="higher-ranked neighbours"):
        levels.decide(0, 2, 5)
    assert levels.due(7) == {0: 4} and levels.in_force == {0: 4}
    assert levels.reset(0) and levels.in_force == {}


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(("follow", "level"), [(False, "rank=256"), (True, "rank=1")])
def test_simulate_without_a_coordinator_reports_the_levels_the_peers_set(tmp_path, follow, level):
    """`simulate --adaptive --no-coordinator` with a budget no link can exceed: every link goes
    to one rank at the same round at both ends, as the report's link_levels show: the top
    with `--no-follow-loss`, else the lowest (the loss has not fallen fourfold by round 12;
    the trainer notes it to the peers)."""
    path = tmp_path / "report.json"
    argv = ["--topology", "ring4", "--adaptive", "--no-coordinator", "--round-budget", "100"]
    argv += [] if follow else ["--no-follow-loss"]
    argv += ["--rounds", "12", "--workers", "1", "--eval-every", "0"]
    assert main(["simulate", "--quiet", "--report", str(path), *argv]) == 0
    report = json.loads(path.read_text())
    assert [c["link"] for c in report["link_levels"]] == [[0, 1], [0, 3], [1, 2], [2, 3]]
    assert {c["round"] for c in report["link_levels"]} == {MIN_SENDS + NOTICE_LEAD}
    assert {c["level"] for c in report["link_levels"]} == {level}
    assert report["mismatched_epoch_exchanges"] == 0
    assert all(p["failed_exchanges"] == 0 for p in report["per_peer"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--no-coordinator"], "expected --adaptive with it"),
        (["simulate", "--adaptive", "--no-coordinator", "--coordinator"], "--coordinator works"),
        (["simulate", "--adaptive", "--no-coordinator", "--boost"], "--boost works"),
        (
            ["simulate", "--adaptive", "--no-coordinator", "--hold-lowest-until", "5"],
            "--hold-lowest-until works",
        ),
        (["simulate", "--hold-lowest-until", "5"], "--hold-lowest-until: expected --adaptive"),
        (
            ["simulate", "--adaptive", "--hold-lowest-until", "-1"],
            "must be in [0, 9007199254740991], got -1",
        ),
        (["simulate", "--round-budget", "1"], "--round-budget: expected --adaptive"),
        (["simulate", "--boost"], "--boost: expected --adaptive"),
        (
            ["peer", "--topology", "ring4", "--rank", "0", "--adaptive", "--coordinator", "x:1"],
            "expected one of them",
        ),
        (["peer", "--topology", "ring4", "--rank", "0", "--round-budget", "1"], "--adaptive"),
    ],
)
def test_contradicting_level_flags_are_refused(capsys, argv, message):
    """Each refused before anything runs, naming the flag and what it needs."""
    assert main([*argv, "--rounds", "1"]) == 2
    assert message in capsys.readouterr().err


def test_a_schedule_staged_while_a_notice_waits_takes_the_new_level_at_its_round(one_thread):
    """Peers set levels and gossip merged (a static schedule, as `--schedule single` without a
    coordinator, staged after the first notices and in force before their round): the level
    still changes at the notice's round at both ends, under the new epoch, without a failure."""
    peers, _ = _adapting_ring()
    try:
        for _ in range(MIN_SENDS + 1):
            gossip_round(peers)
        assert peers[0]._edge_levels.waiting()[1].effective_round == MIN_SENDS + NOTICE_LEAD
        names = tuple(name for name, _ in peers[0].gossiped)
        merged = Schedule(1, MIN_SENDS + 2, (TensorGroup(names, "identity"),), planner="single")
        for peer in peers:
            peer.apply(merged)
        for _ in range(NOTICE_LEAD + 2):
            gossip_round(peers)
            _assert_ends_agree(peers)
        for peer in peers:
            assert peer.stats.failed_exchanges == {}
            assert peer.schedules.current.epoch == 1
        assert _rank(peers[0], 1) == _rank(peers[1], 0) == 32
    finally:
        helpers.close_all(peers)


def test_a_network_restored_while_notices_wait_switches_at_their_round(one_thread):
    """Every peer checkpointed two rounds after the first notices (they wait for round 8) and
    restored into fresh peers: the edges need no resynchronisation, both ends of every edge
    switch at round 8 as announced, and nothing fails."""
    peers, _ = _adapting_ring()
    try:
        for _ in range(MIN_SENDS + 2):
            gossip_round(peers)
        states = [peer.state_dict() for peer in peers]
    finally:
        helpers.close_all(peers)
    restored, _ = _memory_ring(helpers.mlp_models(4))
    try:
        for peer, state in zip(restored, states, strict=True):
            peer.adapt_levels(1e3)
            peer.load_state_dict(state)
        run_in_threads([lambda p=p: p.start(5, {}) for p in restored])
        for _ in range(NOTICE_LEAD):
            gossip_round(restored)
            _assert_ends_agree(restored)
        for a, b in EDGES:
            assert _rank(restored[a], b) == _rank(restored[b], a) == 32
            for r in (a, b):
                assert [
                    c["round"] for c in restored[r].stats.link_levels if c["link"] == [a, b]
                ] == [MIN_SENDS + NOTICE_LEAD]
        for peer in restored:
            assert peer.stats.failed_exchanges == {}
    finally:
        helpers.close_all(restored)
