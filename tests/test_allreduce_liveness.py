"""Heartbeat values in the rendezvous store are hostile until checked (anyone who reaches the
store's port can write them): `Liveness.explain` still returns a `RankFailure` naming the silent
rank, and names a pid only when the value carries a plain one.

A real TCPStore in this process; the other rank's key is written by hand, once, so it goes stale.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from gossipcomp.allreduce.liveness import (
    MAX_BEAT_CHARS,
    PREFIX,
    Heartbeats,
    Liveness,
    RankFailure,
    first_line,
    name_ranks,
)

TIMEOUT_S = 0.6


@pytest.fixture()
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5))


HOSTILE = {
    "superscript two as pid": "1 ² host",
    "arabic-indic digits as pid": "1 \u0663\u0664 host",
    "fullwidth digits as pid": "1 \uff11\uff12 host",
    "negative pid": "1 -5 host",
    "empty": "",
    "pid of 40 digits": "1 " + "9" * 40 + " host",
    "pid beyond the cut": "1 " + "7" * (MAX_BEAT_CHARS + 10) + " host",
    "8 MiB less a little": "1 " + "8" * ((8 << 20) - 64),
    "not utf-8": b"1 \xff\xfe host",
}


@pytest.mark.parametrize("value", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_heartbeat_still_gives_a_rank_failure_naming_the_rank(
    store: dist.TCPStore, value: str | bytes
) -> None:
    store.set(f"{PREFIX}1", value)
    liveness = Liveness(store, 0, 2, TIMEOUT_S).start()
    try:
        failure = liveness.explain(RuntimeError("Connection closed by peer"))
    finally:
        liveness.stop()
    assert isinstance(failure, RankFailure), failure
    assert failure.ranks == (1,)
    said = "rank 1 never beat" if value == "" else "rank 1 stopped"  # "" reads as not started
    assert str(failure).startswith(said), str(failure)
    assert "pid" not in str(failure), str(failure)  # none of these carries a plain pid
    assert len(str(failure)) < 1000  # the value is never echoed


def test_a_plain_heartbeat_names_its_pid_and_host(store: dist.TCPStore) -> None:
    store.set(f"{PREFIX}1", "3 4242 node-7.example")
    watch = Heartbeats(store, [1])
    watch.poll()
    assert watch.where(1) == "pid 4242 on node-7.example"
    store.set(f"{PREFIX}1", "4 4242 bad/host")
    watch.poll()
    assert watch.where(1) == "pid 4242"


def test_ranks_are_named_one_way_by_every_error() -> None:
    from gossipcomp.allreduce import agreement, comm

    assert name_ranks([2]) == "rank 2"
    assert name_ranks((0, 3)) == "ranks 0, 3"
    # one helper each, shared: agreement's and comm's messages use liveness's
    assert agreement.name_ranks is name_ranks
    assert comm.first_line is first_line
    assert not hasattr(agreement, "_ranks")
