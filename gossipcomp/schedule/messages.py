"""Schedules as coordinator.proto `Schedule` messages, both ways.

The coordinator publishes schedules in them and peers pass them to each other (Gossip.Schedules),
so the conversion lives here, below both, and a peer never loads the coordinator's service.
"""

from __future__ import annotations

from gossipcomp.proto.v1 import coordinator_pb2 as cpb
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
    )


def schedule_from_proto(message: cpb.Schedule) -> Schedule:
    """A received schedule; ScheduleRefused naming the field when out of range (the peer
    checks it against its model and topology when staging it)."""
    groups = tuple(TensorGroup(tuple(g.names), g.compressor) for g in message.groups)
    links = tuple(LinkLevel(x.low, x.high, x.level) for x in message.links)
    return Schedule(
        message.epoch, message.effective_round, groups, message.planner, links, message.budget_s
    )
