"""Gossip.Schedules serves a peer's schedules serialised once per change of its schedule book,
never per request, and a flood of the calls from one caller leaves honest rounds bounded
(issue 23 review: a schedule may hold 65,536 groups and 2^20 links, and rebuilding its message
on the event loop for every call let one caller stall Push receipt). Three peers on a ring
over real gRPC on loopback."""

from __future__ import annotations

import threading
import time
from functools import partial

import grpc
import torch
from conftest import grpc_network, run_in_threads
from torch import nn

import gossipcomp.peer.schedules as peer_module
from gossipcomp.compress import parse_spec
from gossipcomp.gossip import Choco
from gossipcomp.peer import Peer
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.schedule import messages
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.schedule import Schedule
from gossipcomp.topology import build_topology
from gossipcomp.transport.base import PROTOCOL_VERSION

RING3 = build_topology("ring", n=3)
TENSORS = 64  # one group each in the schedule served


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(2, 2, bias=False) for _ in range(TENSORS)))


def _peers() -> list[Peer]:
    models = [_model(r) for r in range(3)]
    choco = partial(Choco, parse_spec("sign"), consensus_step=0.4)
    return grpc_network(RING3, models, choco, round_timeout=2.0)


def _schedule(peer: Peer) -> Schedule:
    groups = tuple(TensorGroup((name,), "sign") for name, _ in peer.gossiped)
    return Schedule(1, peer.round + 40, groups, "test")


def _asking(peer: Peer, sender: int) -> pb.HelloRequest:
    return pb.HelloRequest(
        protocol_version=PROTOCOL_VERSION,
        sender=sender,
        topology_hash=RING3.hash,
        model_signature=peer.signature,
        schedule_epoch=0,
    )


def test_schedules_are_serialised_once_per_change_not_per_request(monkeypatch):
    built = []

    def counting(schedule):
        built.append(schedule.epoch)
        return to_proto(schedule)

    to_proto = messages.schedule_to_proto
    monkeypatch.setattr(messages, "schedule_to_proto", counting)
    # the old peer built the message itself, from the name it imported
    monkeypatch.setattr(peer_module, "schedule_to_proto", counting, raising=False)
    peers = _peers()
    try:
        schedule = _schedule(peers[0])
        peers[0].apply(schedule)
        after_apply = len(built)
        assert after_apply >= 1  # the change was serialised, once
        with grpc.insecure_channel(peers[0].address) as channel:
            call = channel.unary_unary(
                "/gossipcomp.v1.Gossip/Schedules",
                pb.HelloRequest.SerializeToString,
                pb.ScheduleList.FromString,
            )
            for _ in range(50):
                answer = call(_asking(peers[0], 1), timeout=5)
                assert [s.epoch for s in answer.schedules] == [1]
                assert messages.schedule_from_proto(answer.schedules[0]) == schedule
            assert not call(
                pb.HelloRequest(**{**_fields(_asking(peers[0], 1)), "schedule_epoch": 1}),
                timeout=5,
            ).schedules  # nothing past the epoch it holds
        assert len(built) == after_apply, f"{len(built) - after_apply} rebuilt for 51 requests"
    finally:
        for peer in peers:
            peer.close()


def _fields(message: pb.HelloRequest) -> dict:
    return {f.name: v for f, v in message.ListFields()}


def test_a_flood_of_schedules_calls_leaves_honest_rounds_bounded():
    """One caller (neighbour 1's identity on one connection) asks peer 0 for its schedules
    from 8 threads without pause while the three peers gossip: every round still ends within
    its deadline with both neighbours heard, and the flood only ever gets answers or
    RESOURCE_EXHAUSTED (the per-caller slot), never a stalled or broken server."""
    peers = _peers()
    stop = threading.Event()
    codes: dict[str, int] = {}
    lock = threading.Lock()
    try:
        peers[0].apply(_schedule(peers[0]))
        request = _asking(peers[0], 1)
        channel = grpc.insecure_channel(peers[0].address)
        call = channel.unary_unary(
            "/gossipcomp.v1.Gossip/Schedules",
            pb.HelloRequest.SerializeToString,
            pb.ScheduleList.FromString,
        )

        def flood() -> None:
            while not stop.is_set():
                try:
                    call(request, timeout=5)
                    code = "OK"
                except grpc.RpcError as error:
                    code = error.code().name
                with lock:
                    codes[code] = codes.get(code, 0) + 1

        flooders = [threading.Thread(target=flood, daemon=True) for _ in range(8)]
        for thread in flooders:
            thread.start()
        time.sleep(0.5)
        heard_all, slowest = [], 0.0

        def rounds(peer: Peer) -> None:
            nonlocal slowest
            for _ in range(10):
                started = time.monotonic()
                peer.gossip()
                slowest = max(slowest, time.monotonic() - started)
                heard_all.append(not peer.alone)

        run_in_threads([lambda p=p: rounds(p) for p in peers], timeout=120)
        stop.set()
        for thread in flooders:
            thread.join(10)
        channel.close()
        assert all(heard_all), "a round heard no neighbour during the flood"
        assert slowest < 2.0 * peers[0].round_timeout, f"a round took {slowest:.2f} s"
        assert codes.get("OK", 0) > 0
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert peers[0].schedules.newest.epoch == 1
    finally:
        stop.set()
        for peer in peers:
            peer.close()


def test_a_malformed_handshake_is_refused_by_the_shared_parser():
    """Hello and Schedules take their HelloRequest parsed by serving.py (Method.request), as
    every unary method does: bytes that are no HelloRequest are INVALID_ARGUMENT naming the
    message expected, and the peer answers a good handshake afterwards."""
    peers = _peers()
    try:
        with grpc.insecure_channel(peers[0].address) as channel:
            for method in ("Hello", "Schedules"):
                raw = channel.unary_unary(f"/gossipcomp.v1.Gossip/{method}")
                try:
                    raw(b"\xff\xff\xff", timeout=5)
                except grpc.RpcError as error:
                    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, method
                    assert error.details() == "request: expected a HelloRequest message"
                else:
                    raise AssertionError(f"{method}: a malformed request was answered")
            hello = channel.unary_unary(
                "/gossipcomp.v1.Gossip/Hello",
                pb.HelloRequest.SerializeToString,
                pb.HelloReply.FromString,
            )
            request = _asking(peers[0], 1)
            request.round = peers[0].round
            assert hello(request, timeout=5).receiver == 0
    finally:
        for peer in peers:
            peer.close()
