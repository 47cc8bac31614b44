"""Live membership (topology/members.py, peer/membership.py): the graph of a round is the family
over the members a schedule names; member sets are checked like any schedule (ranks outside
the capacity, unsorted, epochs far ahead, a fixed topology: refused); D-PSGD keeps the network's
sum across a change of members, over real gRPC."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from conftest import build_network, gossip_round, grpc_network, run_in_threads, stacked
from helpers import close_all, mlp_models, stranger_hello

from gossipcomp.cli import main
from gossipcomp.compress import parse_spec
from gossipcomp.gossip import DPSGD, Choco, EdgeChoco, PowerGossip
from gossipcomp.peer.links import LinkState
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.schedule.messages import schedule_from_proto, schedule_to_proto
from gossipcomp.schedule.schedule import Schedule, ScheduleBook, ScheduleRefused
from gossipcomp.topology import TopologyError, build_topology, topology_from_dict

LIVE_RING = build_topology("ring", n=6, members=[0, 1, 2, 3])


def test_the_graph_of_a_round_is_the_family_over_the_members_in_rank_order():
    third = pytest.approx(1 / 3)
    assert LIVE_RING.member_weights(0, 0, ()) == {1: third, 3: third}  # the initial members
    assert LIVE_RING.member_weights(4, 0, ()) == {}  # not a member: mixes with nobody
    # a ring over ranks 0, 2, 4, 5: positions in rank order, Metropolis weights renormalised
    assert LIVE_RING.member_weights(4, 0, (0, 2, 4, 5)) == {2: third, 5: third}
    assert LIVE_RING.member_weights(0, 0, (0, 5)) == {5: pytest.approx(0.5)}
    assert LIVE_RING.member_weights(0, 0, (0,)) == {}
    # every pair of the capacity may become neighbours: the union is the complete graph
    assert LIVE_RING.graph.number_of_edges() == 15
    base = build_topology("base-k", n=8, k=1, members=[1, 2, 3, 5, 6, 7])
    rows = [base.member_weights(1, t, ()) for t in range(4)]
    assert all(len(row) <= 1 for row in rows) and any(rows)  # at most k = 1 neighbour a round


def test_a_live_topology_hashes_its_family_and_members_and_survives_pickling():
    other_members = build_topology("ring", n=6, members=[0, 1, 2])
    other_family = build_topology("exponential", n=6, members=[0, 1, 2, 3])
    hashes = {LIVE_RING.hash, other_members.hash, other_family.hash}
    assert len(hashes) == 3
    assert build_topology("ring", n=6).hash not in hashes
    copy = pickle.loads(pickle.dumps(LIVE_RING))
    assert copy.hash == LIVE_RING.hash
    assert copy.member_weights(2, 5, (1, 2, 3)) == LIVE_RING.member_weights(2, 5, (1, 2, 3))


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ({"kind": "torus", "rows": 2, "cols": 3, "members": [0]}, "members given for kind"),
        ({"kind": "one-peer-exponential", "n": 8, "members": [0]}, "members given for kind"),
        ({"kind": "ring", "n": 4, "members": [0, 7]}, "distinct ranks in 0..3"),
        ({"kind": "ring", "n": 4, "members": [1, 1]}, "distinct ranks in 0..3"),
        ({"kind": "ring", "n": 4, "members": []}, "non-empty list"),
        ({"kind": "ring", "n": 4, "members": "0-3"}, "non-empty list"),
        ({"kind": "ring", "n": 4, "members": [0], "weights": "uniform"}, "metropolis"),
        ({"kind": "ring", "n": 5000, "members": [0]}, "complete union"),
    ],
)
def test_hostile_live_topology_files_are_refused_naming_the_key(spec, fragment):
    with pytest.raises(TopologyError, match=fragment):
        topology_from_dict(spec)


def _book(capacity: int | None = 6) -> ScheduleBook:
    return ScheduleBook(["w"], capacity=capacity)


@pytest.mark.parametrize(
    "members,capacity,fragment",
    [
        ((0, 6), 6, "member 6 is outside the topology's capacity; expected ranks 0..5"),
        ((0, 2**20), 6, "expected ranks in"),
        ((0, 1), None, "membership is fixed"),
    ],
)
def test_a_member_set_the_topology_cannot_hold_is_refused_and_changes_nothing(
    members, capacity, fragment
):
    book = _book(capacity)
    with pytest.raises(ScheduleRefused, match=fragment):
        book.stage(Schedule(1, 5, members=members), 0)
    assert book.newest.epoch == 0 and book.staged == ()


@pytest.mark.parametrize("members", [(2, 1), (1, 1), (-1, 2), (True, 2)])
def test_unsorted_repeated_or_negative_members_are_refused_on_arrival(members):
    message = cpb.Schedule(
        epoch=1, effective_round=5, planner="p", members=[int(m) for m in members]
    )
    if members == (True, 2):  # a bool is no rank (the Python API's side of the check)
        with pytest.raises(ScheduleRefused, match="members"):
            Schedule(1, 5, members=members)
        return
    with pytest.raises(ScheduleRefused, match="members"):
        schedule_from_proto(message)


def test_a_membership_epoch_far_ahead_is_refused_by_the_one_bound_on_epochs():
    book = _book()
    with pytest.raises(ScheduleRefused, match="epochs cannot be used up"):
        book.stage(Schedule(10**6, 5, members=(0, 1)), 0)
    with pytest.raises(ScheduleRefused, match="expected at most"):
        book.stage(Schedule(2, 10**9, members=(0, 1)), 0)  # a round far ahead
    assert book.staged == ()


def test_members_travel_in_messages_and_checkpoints_unchanged():
    schedule = Schedule(3, 9, members=(0, 2, 5))
    assert schedule_from_proto(schedule_to_proto(schedule)) == schedule
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    old = schedule.to_dict()
    del old["members"]  # a checkpoint written before live membership
    assert Schedule.from_dict(old).members == ()


def test_broadcasting_algorithms_are_refused_on_a_live_topology():
    with pytest.raises(ValueError, match="live topology"):
        grpc_network(
            LIVE_RING, mlp_models(4), lambda: Choco(parse_spec("sign"), consensus_step=0.4)
        )


@pytest.mark.parametrize(
    "algorithm",
    [DPSGD, lambda: PowerGossip(rank=1), lambda: EdgeChoco(parse_spec("topk:ratio=0.2"))],
    ids=["dpsgd", "pg", "choco-edge"],
)
def test_gossip_keeps_the_sum_across_a_change_of_members_and_mixes_the_new_graph(algorithm):
    """Ranks 0..3 of a live ring gossip (exact D-PSGD, or PowerGossip, no training); a schedule
    removes rank 3 from round 6: every round, across the change too, keeps the sum over the four
    peers (rank 3 keeps its own model once out), and from round 6 ranks 0, 1, 2 mix on the ring
    over them (weights 1/3: one round of D-PSGD averages them exactly; PowerGossip uses the
    new edge 0-2 from its own per-edge state at both ends, and choco-edge from the edge's pair
    of copies, at zero at both ends until then)."""
    topology = build_topology("ring", n=4, members=[0, 1, 2, 3])
    peers = grpc_network(topology, mlp_models(4), algorithm, round_timeout=10.0)
    try:
        before = [x.sum(0) for x in stacked(peers)]
        for _ in range(3):
            gossip_round(peers)
        removal = Schedule(1, 6, members=(0, 1, 2))
        for peer in peers:
            peer.apply(removal)
        out = None
        for _ in range(6):
            gossip_round(peers)
            for b, x in zip(before, stacked(peers), strict=True):
                torch.testing.assert_close(x.sum(0), b, atol=1e-6, rtol=0)
            if peers[0].round > 6 and out is None:
                out = [p.detach().clone() for p in peers[3].model.parameters()]
        assert [p.round for p in peers[:3]] == [9, 9, 9]
        assert peers[3].round == 6 and not peers[3].member  # out: it does no rounds
        assert peers[0].members == (0, 1, 2)
        if algorithm is DPSGD:  # one round of the 3-ring (all weights 1/3) averages
            for x in stacked(peers[:3]):
                assert float((x - x.mean(0)).abs().max()) < 1e-6
        else:  # the new edge 0-2 carries gossip: both ends heard each other
            assert peers[0].stats.bytes_received.get(2, 0) > 0
            assert peers[2].stats.bytes_received.get(0, 0) > 0
        if isinstance(peers[0].algorithm, EdgeChoco):  # the new edge's copies, alike at both ends
            for i, j in ((0, 2), (2, 0)):
                mine, theirs = peers[i].algorithm.own[j], peers[j].algorithm.theirs[i]
                assert all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))
                assert any(float(x.abs().sum()) > 0 for x in mine)
        assert out is not None
        for p, q in zip(out, peers[3].model.parameters(), strict=True):
            assert torch.equal(p, q)  # rank 3 mixes with nobody
        failed = [sum(p.stats.failed_exchanges.values()) for p in peers]
        assert failed == [0, 0, 0, 0]  # nobody waited on rank 3's edges
    finally:
        close_all(peers)


def test_peers_of_one_process_run_a_live_topology_in_threads():
    """Several peers derive the family's graph at once (the built graphs are shared)."""
    topology = build_topology("random-matching", n=6, members=[0, 1, 2, 3, 4], seed=3)
    rows = run_in_threads(
        [lambda r=r: [topology.member_weights(r, t, ()) for t in range(50)] for r in range(5)]
    )
    for t in range(50):
        for r in range(5):
            for j, w in rows[r][t].items():
                assert rows[j][t][r] == w  # both ends agree on every edge of every round


@pytest.fixture
def live_file(tmp_path):
    path = tmp_path / "live.yaml"
    path.write_text("kind: ring\nn: 6\nmembers: [0, 1, 2, 3]\n")
    return path


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["peer", "--rank", "0"], "expected --coordinator HOST:PORT"),
        (["simulate"], "simulate runs every rank of a fixed topology"),
    ],
)
def test_live_membership_without_a_coordinator_is_refused_loudly(
    live_file, tmp_path, capsys, argv, fragment
):
    report = tmp_path / "report.json"
    assert main([*argv, "--topology", str(live_file), "--report", str(report)]) == 2
    assert fragment in " ".join(capsys.readouterr().err.split())
    assert not report.exists()


def test_join_on_a_fixed_topology_is_refused(tmp_path, capsys):
    argv = ["peer", "--rank", "0", "--topology", "ring4", "--join", "--coordinator", "x:1"]
    assert main([*argv, "--report", str(tmp_path / "r.json")]) == 2
    assert "--join: expected a live topology" in " ".join(capsys.readouterr().err.split())
    with pytest.raises(ValueError, match="needs a live topology"):
        grpc_network(build_topology("ring", n=4), mlp_models(4), DPSGD, joining=True)


def test_the_guides_live_membership_example_is_a_live_topology():
    guide = (Path(__file__).resolve().parent.parent / "docs/guides/topologies.md").read_text()
    section = guide.split("## Live membership", 1)[1]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.DOTALL)
    topology = topology_from_dict(yaml.safe_load(block))
    assert topology.live is not None and topology.live.initial == (0, 1, 2, 3)
    assert topology.n == 8


def test_a_handshake_from_outside_the_members_or_the_capacity_is_refused():
    """A live ring of capacity 5, members 0..3: a Hello claiming rank 7 (outside the capacity)
    is refused at the door; one from rank 4 (a rank of the capacity, not a member) is not
    answered with a resume round, and the member's edge to rank 4 stays down."""
    topology = build_topology("ring", n=5, members=[0, 1, 2, 3])
    peers = grpc_network(topology, mlp_models(4), DPSGD, round_timeout=10.0)
    try:
        with grpc.insecure_channel(peers[0].address) as channel:
            with pytest.raises(grpc.RpcError) as stranger:
                stranger_hello(channel, 7, topology, mlp_models(1)[0], round=0)
            assert stranger.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as outsider:
                stranger_hello(channel, 4, topology, mlp_models(1)[0], round=0, alone=True)
            assert "not a member" in outsider.value.details()
        assert peers[0].links.state(4) is LinkState.DOWN
        gossip_round(peers)
        assert peers[0].links.state(4) is LinkState.DOWN
    finally:
        close_all(peers)


def test_topology_show_says_a_topology_is_live_and_names_its_members(live_file, capsys):
    assert main(["topology", "show", str(live_file)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "live membership yes" in out and "capacity 6 ranks (0..5)" in out
    assert "initial members 0, 1, 2, 3" in out
    assert "ring over them: SLEM 0.3333" in out  # 4-ring, weights 1/3: eigenvalues 1, ±1/3


def test_a_neighbour_cannot_announce_others_departures_only_the_coordinator_can():
    """A schedule a neighbour passes on (Peer.adopt: what a fetch of its schedules stages) that
    changes the members is refused, the book unchanged; the same schedule from the
    coordinator (Peer.apply) is staged; a neighbour's schedule naming the members held (here
    the initial ones, named explicitly) is adopted."""
    topology = build_topology("ring", n=5, members=[0, 1, 2, 3])
    peers = build_network(topology, mlp_models(4), DPSGD)
    try:
        removal = Schedule(1, 10, members=(0, 1, 2))
        with pytest.raises(ScheduleRefused, match="only the coordinator's own schedules"):
            peers[0].adopt(removal)
        with pytest.raises(ScheduleRefused, match="changes the members"):
            peers[0].adopt(Schedule(1, 10, members=(0, 1, 2, 3, 4)))  # nor arrivals
        assert peers[0].schedules.newest.epoch == 0
        peers[1].apply(removal)
        assert peers[1].schedules.newest == removal
        assert peers[2].adopt(Schedule(1, 10, planner="p", members=(0, 1, 2, 3)))
    finally:
        close_all(peers)
