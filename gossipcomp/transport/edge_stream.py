"""One long-lived `Gossip.Link` stream per edge, for the envelopes that fit in one chunk.

A round of PowerGossip on a ring sends each neighbour two small envelopes. As unary calls
(PushOne) each paid gRPC's set-up on both ends, which in one process running many peers cost
more than the checks and the data (docs/benchmarks.md, "Engine: a stream per edge"). On a link
the envelope is one message of a stream that stays open, answered in order by one LinkReply.

The sender's side is here; the receiver's (the same checks as PushOne, the bounds on a link's
time) is in grpc_service.py. A reply is a neighbour's word: its status must be a gRPC code and its details
are cut to MAX_LINK_DETAILS characters before anyone shows them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from gossipcomp.inputs.text import quoted
from gossipcomp.proto.v1 import gossip_pb2 as pb

MAX_LINK_DETAILS = 1024  # characters of a refusal's details on a link, either end
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class LinkRefusal(grpc.RpcError):
    """An envelope sent on a link and not delivered: refused by the receiver (the status and
    details PushOne would have ended its call with), not answered in time, or the link lost.
    Read like a failed gRPC call: `code()` and `details()`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def refusal_reply(code: grpc.StatusCode, details: str) -> pb.LinkReply:
    """The receiver's answer to an envelope it refuses (details cut to MAX_LINK_DETAILS)."""
    if len(details) > MAX_LINK_DETAILS:
        details = details[: MAX_LINK_DETAILS - 3] + "..."
    return pb.LinkReply(status=code.value[0], details=details)


def delivered_bytes(reply: pb.LinkReply, neighbour: int) -> int:
    """The bytes a reply says were received; raises LinkRefusal with the refusal's status,
    or with INTERNAL when the status is not a gRPC code or the details are too long."""
    if reply.status == 0:
        return reply.received_bytes
    code = _CODES.get(reply.status)
    if code is None or len(reply.details) > MAX_LINK_DETAILS:
        raise LinkRefusal(
            grpc.StatusCode.INTERNAL,
            f"peer {neighbour} answered on its link with status {reply.status} and "
            f"{len(reply.details)} characters of details (expected a gRPC status code and at "
            f"most {MAX_LINK_DETAILS}): {quoted(reply.details)}",
        )
    raise LinkRefusal(code, reply.details)


class EdgeStream:
    """The sender's end of one edge's link: envelopes go one at a time, each answered before
    the next is written, so a reply always belongs to the envelope just sent.

    The stream is opened at the first send and again after the receiver ended it (idle), once
    per send; a send cancelled or failed half-way drops the stream (its reply would answer the
    wrong envelope) and the next send opens a new one.
    """

    def __init__(self, neighbour: int, open_stream: Callable[[], grpc.aio.StreamStreamCall]):
        self._neighbour = neighbour
        self._open = open_stream
        self._call: grpc.aio.StreamStreamCall | None = None
        self._turn = asyncio.Lock()

    async def send(self, chunk: bytes, timeout: float) -> int:
        """Send one serialised EnvelopeChunk and wait for its answer; returns the bytes sent.
        Raises LinkRefusal when it is refused or not answered within `timeout` seconds, or
        grpc.aio.AioRpcError when the link itself fails."""
        try:
            async with asyncio.timeout(timeout):
                async with self._turn:
                    for _ in range(2):  # a link the receiver ended while idle: once more
                        reply = await self._answer(chunk)
                        if reply is not None:
                            delivered_bytes(reply, self._neighbour)
                            return len(chunk)
        except TimeoutError:
            raise LinkRefusal(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer from peer {self._neighbour} on its link within {timeout:.3g} s",
            ) from None
        raise LinkRefusal(
            grpc.StatusCode.UNAVAILABLE,
            f"peer {self._neighbour} ended two links in a row without answering",
        )

    async def _answer(self, chunk: bytes) -> pb.LinkReply | None:
        """`chunk`'s reply on the open link (opened if need be); None when the receiver had
        ended the link before reading it (ended links read nothing), so it may go again."""
        if self._call is not None and self._call.done():
            self._call = None
        reused = self._call is not None
        call = self._call = self._call or self._open()
        finished = False
        try:
            try:
                await call.write(chunk)
            except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                if not reused:  # a link just opened that takes nothing: a real failure
                    raise
                finished = True  # the receiver ended it as we wrote: nothing was sent
                self._call = None
                return None
            reply = await call.read()
            finished = True
        finally:
            if not finished:  # cancelled or failed half-way: its reply would answer the next
                self.drop()
        if reply is grpc.aio.EOF:
            self._call = None
            return None
        if not isinstance(reply, pb.LinkReply):  # gRPC gives None for bytes that do not parse
            self.drop()
            raise LinkRefusal(
                grpc.StatusCode.INTERNAL,
                f"peer {self._neighbour} answered on its link with a message that is not a "
                "LinkReply",
            )
        return reply

    def drop(self) -> None:
        """Cancel the open link, if any (a send failed half-way: its reply must not be read)."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
