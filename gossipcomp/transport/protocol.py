"""The Transport protocol: what a peer needs of whatever moves its bytes.

Apart from transport/base.py (the values on the wire and in results) because it names the
Inbox, which is built on those values: base <- inbox <- protocol, no import cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

from gossipcomp.transport.base import (
    ExchangeResult,
    Greeting,
    HelloAnswer,
    HelloHandler,
    Outgoing,
)

if TYPE_CHECKING:  # a type only: importing the inbox here would load levels/notices.py from
    # the transport package's __init__, which levels/notices.py itself imports (a cycle)
    from gossipcomp.transport.inbox import Inbox


class Transport(Protocol):
    """Moves one payload per neighbour per (round, phase) and returns what the neighbours sent.

    A transport is how bytes move: the handshake (`connect`, `probe`), the exchange and
    `close`. What the peer expects, accepts and announces is its `inbox`
    (transport/inbox.py), one object every transport holds and the peer calls directly.
    """

    rank: int
    schedule_epoch: int  # the newest schedule epoch the peer has: told in every handshake
    inbox: Inbox  # expectations, notices and the mailbox, checked before anything is stored

    def connect(
        self, addresses: Mapping[int, str], timeout: float, greeting: Greeting | None = None
    ) -> dict[int, HelloAnswer]:
        """Handshake with every neighbour (rank -> address) within `timeout` seconds, or raise
        PeerUnreachableError naming the missing ones (HandshakeError on a mismatch), telling each
        `greeting` (default: a fresh peer at round 0). Envelopes are accepted from the
        greeting's round on, and a neighbour at another round answers with a resume round, as
        does one asked to resume by its proposals."""
        ...

    def set_hello_handler(self, handler: HelloHandler) -> None:
        """Who answers neighbours' handshakes (and their requests to resume an edge)."""
        ...

    def probe(self, neighbour: int, round: int, proposed: int, alone: bool) -> Future[HelloAnswer]:
        """Handshake again with a lost neighbour, without blocking, asking to resume the edge."""
        ...

    def exchange(
        self, round: int, phase: str, outgoing: Outgoing, timeout: float, schedule_epoch: int = 0
    ) -> ExchangeResult:
        """Send outgoing[j] to each neighbour j and wait, until the deadline, for j's payload.
        Envelopes carry `schedule_epoch`; one a neighbour sent under another epoch fails that
        neighbour's exchange (and is listed in `epoch_mismatches`): none is ever used."""
        ...

    def close(self) -> None:
        """Release sockets and threads; safe to call twice."""
        ...
