"""Schedules as coordinator.proto `Schedule` messages, both ways.

The coordinator publishes schedules in them and peers pass them to each other (Gossip.Schedules),
so the conversion lives here, below both, and a peer never loads the coordinator's service.
`ScheduleReplies` keeps a peer's answers to Gossip.Schedules serialised: a schedule may hold
65,536 groups and 2^20 links, so building its message for every request would let one caller
stall the event loop that also receives every Push.
"""

from __future__ import annotations

from collections.abc import Iterable

from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.schedule.groups import TensorGroup
from gossipcomp.schedule.schedule import LinkLevel, Schedule


def schedule_to_proto(schedule: Schedule) -> cpb.Schedule:
    """`schedule` as the message the coordinator publishes and peers pass on."""
    return cpb.Schedule(
        epoch=schedule.epoch,
        effective_round=schedule.effective_round,
        planner=schedule.planner,
        groups=[cpb.ScheduleGroup(names=g.names, compressor=g.compressor) for g in schedule.groups],
        links=[cpb.LinkLevel(low=x.low, high=x.high, level=x.level) for x in schedule.links],
        budget_s=schedule.budget_s,
        members=schedule.members,
    )


def schedule_from_proto(message: cpb.Schedule) -> Schedule:
    """A received schedule; ScheduleRefused naming the field when out of range (the peer
    checks it against its model and topology when staging it)."""
    groups = tuple(TensorGroup(tuple(g.names), g.compressor) for g in message.groups)
    links = tuple(LinkLevel(x.low, x.high, x.level) for x in message.links)
    return Schedule(
        message.epoch,
        message.effective_round,
        groups,
        message.planner,
        links,
        message.budget_s,
        tuple(message.members),
    )


class ScheduleReplies:
    """A peer's held schedules, each serialised once as a one-element ScheduleList.

    `refresh` (the training thread, whenever the schedule book changes) rebuilds them;
    `newer_than` (the server, for each request) only joins bytes: ScheduleList messages
    concatenated parse as one list holding all their schedules (protobuf merges repeated fields
    by appending), so no request builds or serialises a message.
    """

    def __init__(self) -> None:
        self._held: tuple[tuple[int, bytes], ...] = ()  # (epoch, serialised), oldest first

    def refresh(self, held: Iterable[Schedule]) -> None:
        """Serialise `held` (the schedule in force and those staged, oldest first)."""
        replies = tuple(
            (s.epoch, pb.ScheduleList(schedules=[schedule_to_proto(s)]).SerializeToString())
            for s in held
        )
        self._held = replies  # one reference swap: the server reads either list whole

    def newer_than(self, epoch: int, limit: int) -> bytes:
        """The serialised ScheduleList of the (at most `limit`) held schedules after `epoch`."""
        newer = [serialised for held, serialised in self._held if held > epoch]
        return b"".join(newer[:limit])
