"""Lying and forged neighbours against running peers: rounds, livelock, poisoned values, streams.

Each test is one finding of the hardening issue, reproduced the way it was observed (a forged
or signed Hello over real gRPC, handshakes that once livelocked a peer, a neighbour sending
1e30, more idle and trickling streams than the old server had threads), and checks what must
hold now.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from functools import partial

import grpc
import pytest
import torch
from conftest import grpc_network, run_in_threads
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import stranger_hello
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gossipcomp.experiment import TrainConfig
from gossipcomp.experiment.simulation import run_simulation
from gossipcomp.gossip import DPSGD
from gossipcomp.gossip.dpsgd import MODEL_PHASE
from gossipcomp.peer import Peer
from gossipcomp.peer.links import MAX_RESUME_MARGIN, RESUME_MARGIN, Backoff, LinkState, RoundPace
from gossipcomp.security import PeerKeys, throwaway_certificates
from gossipcomp.topology import Topology, load_topology, topology_from_dict
from gossipcomp.transport.base import (
    MAX_WIRE_ROUND,
    Envelope,
    Greeting,
    Identity,
    PeerUnreachableError,
)
from gossipcomp.transport.codec import encode_raw
from gossipcomp.transport.grpc_transport import SERVICE_NAME, GrpcOptions, GrpcTransport
from gossipcomp.transport.memory import InMemoryHub, InMemoryTransport
from gossipcomp.transport.wire import envelope_chunks, parse_chunk
from gossipcomp.workload.models import model_signature

FAST_BACKOFF = Backoff(first=0.01, longest=0.05)


def _model(rank: int) -> nn.Module:
    torch.manual_seed(10 + rank)
    return nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3))


def _ring3() -> Topology:
    return topology_from_dict({"name": "ring3", "kind": "ring", "n": 3})


def _all_up(peers: list[Peer]) -> bool:
    return all(
        p.links.state(j) is LinkState.UP for p in peers for j in p.topology.neighbors(p.rank)
    )


def _run_until_all_up(peers: list[Peer], rounds: int, pause: float, seconds: float) -> bool:
    """Gossip on (to `rounds`) until every edge is up or `seconds` pass; whether they all were."""
    running = _Running(peers, rounds=rounds, pause=pause)
    deadline = time.monotonic() + seconds
    while not _all_up(peers) and time.monotonic() < deadline:
        time.sleep(0.01)
    came_back = _all_up(peers)
    running.join(seconds + 30)
    return came_back


class _Running:
    """Every peer gossiping in its own thread until `rounds`, pausing `pause` seconds before
    each round (a stand-in for the local step); counts each peer's gossip calls."""

    def __init__(self, peers: list[Peer], rounds: int, pause: float = 0.003) -> None:
        self.calls = [0] * len(peers)
        self.errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(p, rounds, pause), daemon=True) for p in peers
        ]
        for t in self._threads:
            t.start()

    def _run(self, peer: Peer, rounds: int, pause: float) -> None:
        try:
            while peer.round < rounds:
                time.sleep(pause)
                peer.gossip()
                self.calls[peer.rank] += 1
        except BaseException as error:  # reported by join
            self.errors.append(error)

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "a peer did not finish"
        assert not self.errors, self.errors


def _grpc_ring3(options: list[GrpcOptions | None]) -> list[Peer]:
    models = [_model(r) for r in range(3)]
    dpsgd = partial(DPSGD, consensus_step=1.0)
    return grpc_network(_ring3(), models, dpsgd, options, round_timeout=2.0, backoff=FAST_BACKOFF)


@pytest.mark.parametrize("how", ["plaintext forgery", "signed by the neighbour's own key"])
def test_a_neighbour_claiming_round_a_million_cannot_throw_a_peer_ahead(how):
    """Observed: one Hello from 'peer 0' with round 1,000,000 made peer 1 jump there and stop
    training; signed with peer 0's real key under mutual TLS it was accepted too. Now peer 1
    believes the claim only up to where peer 0 can really be (a few rounds past their last
    round in step), trains every round to the end, and every edge comes back."""
    files_kept = contextlib.ExitStack()
    if how == "plaintext forgery":
        options: list[GrpcOptions | None] = [None] * 3
        liar_options = None
    else:
        private = {r: Ed25519PrivateKey.generate() for r in range(3)}
        public = {r: k.public_key() for r, k in private.items()}
        files = files_kept.enter_context(throwaway_certificates([f"peer{r}" for r in range(3)]))
        options = [
            GrpcOptions(tls=files[f"peer{r}"], keys=PeerKeys(private[r], public)) for r in range(3)
        ]
        liar_options = options[0]  # an insider: peer 0's own certificate and key
    peers = _grpc_ring3(options)
    topology = peers[0].topology
    liar = GrpcTransport(
        Identity(0, topology.hash, model_signature(_model(0))), [1], options=liar_options
    )
    try:
        running = _Running(peers, rounds=200)
        while peers[1].round < 40:
            time.sleep(0.005)
        # refused while peer 1's edge to peer 0 exchanges (issue 23, finding 7); believed only
        # up to where peer 0 can be if the liar's retries land while it is down
        with contextlib.suppress(PeerUnreachableError):
            liar.connect({1: peers[1].address}, timeout=5, greeting=Greeting(round=1_000_000))
        after = [p.round for p in peers]
        running.join(60)
        # believed only up to where peer 0 could be: their last common round plus the margin,
        # plus what twice peer 1's fastest round allows in the few ms since
        assert after[1] <= max(after[0], after[2]) + 4 * RESUME_MARGIN, after
        assert [p.round for p in peers] == [200] * 3
        assert running.calls[1] >= 200 - 4 * RESUME_MARGIN, running.calls  # it kept training
        came_back = _run_until_all_up(peers, rounds=400, pause=0.003, seconds=20)
        assert came_back, [(p.rank, p.round, p.links.not_up()) for p in peers]
    finally:
        liar.close()
        for p in peers:
            p.close()
        files_kept.close()


def test_a_forged_far_resume_proposal_parks_an_edge_for_a_bounded_number_of_rounds():
    """Observed: a Hello proposing resume round 2^63-1000 (alone) cut the edge 0-1 for the rest
    of the run (every later probe got UNKNOWN). Now the proposal keeps at most the largest
    margin, so the edge resumes within MAX_RESUME_MARGIN rounds and every edge is back."""
    peers = _grpc_ring3([None] * 3)
    topology = peers[0].topology
    stranger = grpc.insecure_channel(peers[1].address)
    try:
        running = _Running(peers, rounds=100, pause=0.001)
        while peers[1].round < 20:
            time.sleep(0.005)
        reply = stranger_hello(
            stranger,
            0,
            topology,
            _model(0),
            round=3,
            proposed_resume_round=MAX_WIRE_ROUND - 1000,
            alone=True,
        )
        assert reply.resume_round <= reply.round + RESUME_MARGIN  # the least margin (finding 7)
        running.join(60)
        rounds = 100 + 2 * MAX_RESUME_MARGIN + 200
        came_back = _run_until_all_up(peers, rounds=rounds, pause=0.0005, seconds=60)
        assert came_back, [(p.rank, p.round, p.links.not_up()) for p in peers]
    finally:
        stranger.close()
        for p in peers:
            p.close()


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        (
            {"round_timeout": 0.0},
            r"^round_timeout: expected a finite number in \(0, 86400\], got 0.0$",
        ),
        ({"round_timeout": True}, r"^round_timeout: .*, got True$"),  # a bool is not 1 second
        ({"round_timeout": math.nan}, r"^round_timeout: .*, got nan$"),
        ({"max_move": 0.0}, r"^max_move: expected a finite number in \(0, inf\), got 0.0$"),
        ({"max_move": math.inf}, r"^max_move: .*, got inf$"),
    ],
)
def test_a_peer_refuses_a_round_deadline_or_move_bound_out_of_range(bounds, expected):
    topology = load_topology("topologies/ring4.yaml")
    identity = Identity(1, topology.hash, "m")
    transport = InMemoryTransport(identity, topology.neighbors(1), InMemoryHub())
    try:
        with pytest.raises(ValueError, match=expected):
            Peer(_model(1), topology, 1, DPSGD(), transport, **bounds)
    finally:
        transport.close()


@pytest.mark.parametrize("floor", [0.0, -1.0, math.nan, math.inf, True])
def test_a_round_pace_floor_must_be_a_positive_finite_number_of_seconds(floor):
    expected = r"^round pace floor \(seconds\): expected a finite number in \(0, inf\), got "
    with pytest.raises(ValueError, match=expected):
        RoundPace(floor=floor)


def _lonely_peer(pace: RoundPace | None = None) -> tuple[Peer, InMemoryHub]:
    """Peer 1 of a ring4 over the in-memory hub whose neighbours exist but never gossip (every
    exchange with them fails at a 1 ms deadline); handshakes are injected by the test."""
    topology = load_topology("topologies/ring4.yaml")
    hub = InMemoryHub()
    for r in (0, 2):
        InMemoryTransport(Identity(r, topology.hash, "m"), topology.neighbors(r), hub)
    transport = InMemoryTransport(Identity(1, topology.hash, "m"), topology.neighbors(1), hub)
    peer = Peer(
        _model(1),
        topology,
        1,
        DPSGD(),
        transport,
        round_timeout=0.001,
        backoff=Backoff(first=3600.0, longest=3600.0),  # no probes: only the test's handshakes
        pace=pace,
        max_failed_rounds=0,  # alone on purpose: it must not stop
    )
    return peer, hub


def test_handshakes_from_neighbours_at_22_and_30_no_longer_livelock_a_peer_at_18():
    """Observed: a peer at round 18 greeted by neighbours at 22 and 30 (neither alone) bounced
    between two rounds forever (after 300 gossip() calls it was at round 27)."""
    peer, _ = _lonely_peer(RoundPace(floor=1e-9))  # every claim here is plausible
    peer.round = 18
    peer._answer_hello(0, 22, 0, False, 0)
    peer._answer_hello(2, 30, 0, False, 0)
    rounds = []
    for _ in range(300):
        peer.gossip()
        rounds.append(peer.round)
    assert all(b > a for a, b in zip(rounds, rounds[1:], strict=False)), rounds[:40]
    assert peer.round >= 18 + 300


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    start=st.integers(0, 200),
    events=st.lists(
        st.tuples(
            st.integers(0, 12),  # gossip() calls before the event
            st.sampled_from([0, 2]),  # which neighbour greets
            st.integers(-50, 400),  # its round, relative to the peer's
            st.one_of(st.just(0), st.integers(1, 2 * MAX_RESUME_MARGIN)),  # proposed margin
            st.booleans(),  # says it is alone
        ),
        max_size=12,
    ),
    plausible_everything=st.booleans(),
)
def test_any_sequence_of_handshakes_keeps_a_peer_progressing(start, events, plausible_everything):
    """Random handshakes (rounds, alone flags, proposals) with every resume exchange failing:
    each gossip() call moves the peer forward, except the documented move back of a peer that
    is alone (no live edge) and ran past an agreed resume round, at most once per handshake;
    it logs a bounded amount; and no round ever leaves [0, 2^53)."""
    pace = RoundPace(floor=1e-9) if plausible_everything else None
    peer, _ = _lonely_peer(pace)
    peer.round = start
    handler = _Counter()
    logger = logging.getLogger("gossipcomp")
    logger.addHandler(handler)
    moves_back = 0
    try:
        for calls, sender, offset, margin, alone in [*events, (60, 0, 0, 0, False)]:
            for _ in range(calls):
                before, free = peer.round, not peer.links.live()
                peer.gossip()
                if peer.round <= before:
                    assert free, (before, peer.round)  # back only when alone
                    moves_back += 1
                assert 0 <= peer.round < MAX_WIRE_ROUND
            their = max(0, peer.round + offset)
            peer._answer_hello(sender, their, their + margin if margin else 0, alone, 0)
    finally:
        logger.removeHandler(handler)
    assert moves_back <= len(events) + 1
    assert handler.count <= 6 * (len(events) + 1) + 4, handler.count


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def test_a_restored_peer_still_catches_up_with_a_network_far_ahead():
    """A peer restored from a checkpoint written 20 s ago at ~10 ms a round may believe its
    neighbours up to ~4000 rounds further: it jumps the 1000 rounds they really are ahead."""
    topology = load_topology("topologies/ring4.yaml")
    hub = InMemoryHub()
    peers = []
    for r in range(4):
        transport = InMemoryTransport(Identity(r, topology.hash, "m"), topology.neighbors(r), hub)
        peers.append(
            Peer(
                _model(r), topology, r, DPSGD(), transport, round_timeout=2.0, backoff=FAST_BACKOFF
            )
        )
    for p in peers:
        p.start(5, {})
    run_in_threads([p.gossip for p in peers])
    state = peers[0].state_dict()
    state["saved_at"] -= 20.0
    state["seconds_per_round"] = 0.01
    peers[0].close()
    for p in peers[1:]:  # the network trains on without it
        p.round += 1000
        for j in p.links.live():
            p.links.in_step([j], p.round)
    transport = InMemoryTransport(Identity(0, topology.hash, "m"), topology.neighbors(0), hub)
    restored = Peer(
        _model(0), topology, 0, DPSGD(), transport, round_timeout=2.0, backoff=FAST_BACKOFF
    )
    restored.load_state_dict(state)
    restored.start(5, {})
    assert restored.round >= 1000, restored.round
    running = _Running([restored, *peers[1:]], rounds=1200, pause=0.0005)
    running.join(60)
    assert _all_up([restored, *peers[1:]])


@pytest.mark.parametrize(
    ("field", "value"),
    [("seconds_per_round", 1e-300), ("seconds_per_round", math.nan), ("saved_at", math.inf)],
)
def test_a_checkpointed_pace_that_would_believe_any_round_is_refused(field, value):
    """The checkpoint's pace and age bound how far a restored peer believes its neighbours: a
    pace of 1e-300 s a round would believe any claim, so it is refused, naming the field."""
    peer, _ = _lonely_peer()
    state = peer.state_dict()
    state[field] = value
    with pytest.raises(ValueError, match=f"peer checkpoint: {field}: expected a finite number"):
        peer.load_state_dict(state)
    assert peer.round == 0


def test_a_neighbour_sending_1e30_cannot_make_a_peer_exit():
    """Observed: two envelopes of 1e30 made a peer exit with 'became NaN/Inf'. Now a round that
    would break the model is refused, the neighbour that sent the huge values is taken down
    (and resynchronised later), and honest peers train to the end."""
    config = TrainConfig(
        rounds=40,
        algorithm="dpsgd",
        byzantine=(0,),
        attack="scale",
        attack_scale=1e30,
        round_timeout=3.0,
        eval_every=0,
    )
    report = run_simulation(config, load_topology("topologies/ring4.yaml"))
    assert report.honest_test_accuracy is not None and report.honest_test_accuracy > 0.6


def _idle(stop: threading.Event):
    yield from ()
    stop.wait()


def _trickle(first: bytes, stop: threading.Event):
    yield first
    while not stop.wait(0.2):
        yield b"\x12\x01\x00"  # one data byte at a time


def test_idle_and_trickling_streams_cannot_starve_the_neighbours():
    """Observed: eight Push streams that sent nothing blocked the health check (2 x degree + 4
    worker threads) and peers failed at start-up; eight streams sending only a header made every
    exchange fail. Now 40 idle and 40 trickling streams (five times the old thread count) do not
    delay the health check nor the neighbours' rounds, and are cancelled by the server."""
    peers = _grpc_ring3([None] * 3)
    topology = peers[0].topology
    spec_envelope = _header_only_envelope(peers, topology)
    stop = threading.Event()
    own_connection = [("grpc.use_local_subchannel_pool", 1)]  # a stranger's own connections
    channels = [grpc.insecure_channel(peers[1].address, own_connection) for _ in range(8)]
    calls = []
    try:
        for i in range(40):
            push = channels[i % 8].stream_unary(f"/{SERVICE_NAME}/Push")
            calls.append(push.future(_idle(stop), timeout=120))
            calls.append(push.future(_trickle(spec_envelope, stop), timeout=120))
        time.sleep(0.5)
        with grpc.insecure_channel(peers[1].address) as channel:
            started = time.monotonic()
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - started < 1.0
        running = _Running(peers, rounds=60, pause=0.001)
        running.join(30)
        assert sum(sum(p.stats.failed_exchanges.values()) for p in peers) == 0
        # the server cut them: idle ones after the header time limit, trickling ones after the
        # whole-stream limit (the round deadline, 2 s here)
        codes = [call.exception(10) for call in calls]
        assert [c and c.code() for c in codes] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 80
    finally:
        stop.set()
        for channel in channels:
            channel.close()
        for p in peers:
            p.close()


def _header_only_envelope(peers: list[Peer], topology: Topology) -> bytes:
    """The first chunk of a valid envelope from 'peer 0' for peer 1's early rounds, cut to its
    header: it passes every check, and the trickling streams never finish its data."""
    params = list(peers[1].model.named_parameters())
    envelope = Envelope(0, 2, MODEL_PHASE, tuple(encode_raw(n, p.detach()) for n, p in params))
    first = next(envelope_chunks(envelope))
    header, _ = parse_chunk(first)
    assert header is not None
    serialised = header.SerializeToString()
    return first[: first.index(serialised) + len(serialised)]
