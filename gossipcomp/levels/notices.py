"""Level notices in envelope headers: how they travel and what a receiver accepts.

Without a coordinator, the lower-ranked end of an edge sets the edge's compression level and
announces (level, effective round) in every envelope it sends the other end until that round
(levels/edges.py decides and keeps the levels, levels/peer.py applies them). The notice comes from
the network, so the receiver checks it with the rest of the header, before any data is read
and before anything can change:

- the receiver takes notices at all: it sets levels with its neighbours (FAILED_PRECONDITION
  otherwise: its levels are fixed or come from a coordinator's schedules);
- the sender is the lower-ranked end of the edge (PERMISSION_DENIED): only that end decides;
- the level is on the algorithm's ladder (INVALID_ARGUMENT);
- the effective round lies after the envelope's round and at most `NoticeRules.lead` rounds
  after it (INVALID_ARGUMENT): never in the past, never parked far ahead.

A notice carries no edge: it can only ever name the edge between its sender and its receiver,
so a neighbour cannot change any level but its own edge's. Signed headers cover it
(transport/authentication.py).

Broadcasting algorithms (Choco-SGD, DEF-ATC: `NoticeRules.own_levels`, levels/senders.py)
give a level to a sender, not to an edge: the notice sets the level its sender compresses at,
so any neighbour may announce (the rank rule is dropped) and still only its own level. In an
envelope of the rules' `in_force_phase` (the resume exchange) a notice states the level the
sender uses at that very round: its effective round must equal the envelope's round. Every
other check stays.
"""

from __future__ import annotations

from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.proto.v1 import gossip_pb2 as pb
from gossipcomp.transport.base import EnvelopeRejected, LevelNotice, NoticeRules, RejectCode
from gossipcomp.transport.claims import lead_bound

MAX_NOTICE_LEAD = 64  # rounds a notice may take effect after its envelope's round, at most


def notice_message(notice: LevelNotice) -> pb.LevelNotice:
    return pb.LevelNotice(level=notice.level, effective_round=notice.effective_round)


def notice_of(header: pb.EnvelopeHeader) -> LevelNotice | None:
    """The header's notice (checked already by `check_notice`), None when it has none."""
    if not header.HasField("level_notice"):
        return None
    return LevelNotice(header.level_notice.level, header.level_notice.effective_round)


def check_notice(header: pb.EnvelopeHeader, receiver: int, rules: NoticeRules | None) -> None:
    """Refuse a header whose level notice this receiver must not take (module docstring),
    with EnvelopeRejected naming the field; nothing when it carries none."""
    if not header.HasField("level_notice"):
        return
    sender, round = header.sender, header.round
    level, effective = header.level_notice.level, header.level_notice.effective_round
    if rules is None:
        raise EnvelopeRejected(
            RejectCode.FAILED_PRECONDITION,
            f"level_notice: peer {receiver} takes no link levels from its neighbours (its "
            "levels are fixed or set by a coordinator's schedules); expected no level_notice",
        )
    if sender > receiver and not rules.own_levels:
        raise EnvelopeRejected(
            RejectCode.PERMISSION_DENIED,
            f"level_notice: peer {sender} is the higher-ranked end of edge {receiver}-{sender}; "
            f"only the lower-ranked end (peer {receiver}) announces the edge's level",
        )
    if level not in rules.levels:
        raise EnvelopeRejected(
            RejectCode.INVALID_ARGUMENT,
            f"level_notice.level: expected a level of the ladder {sorted(rules.levels)}, "
            f"got {level}",
        )
    if header.phase == rules.in_force_phase:
        if effective != round:
            raise EnvelopeRejected(
                RejectCode.INVALID_ARGUMENT,
                f"level_notice.effective_round: a {rules.in_force_phase} envelope states the level in "
                f"force at its own round; expected {round}, got {effective}",
            )
        return
    try:
        checked_integer(
            f"level_notice.effective_round (after the envelope's round {round}, at most "
            f"{rules.lead} ahead)",
            effective,
            round + 1,
            lead_bound(round, rules.lead),
        )
    except ValueError as error:
        raise EnvelopeRejected(RejectCode.INVALID_ARGUMENT, str(error)) from None
