"""A producer's spool rules, without a connection: whose spool it is, what is
sent again from it, when a batch waits for room, and what a give-up spools."""

from __future__ import annotations

from pathlib import Path

import pytest

from headgate.client.open_batch import OpenBatchStream
from headgate.client.spool import Spool
from headgate.client.spooling import ProducerSpool
from headgate.protocol.records import decode_records, encode_records

LIMIT = 64 * 1024


def take(s: OpenBatchStream, value: bytes) -> None:
    s.append(value, None, LIMIT, float("inf"))


def test_a_new_spool_takes_our_identity_and_an_old_one_gives_its_own(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20)
    assert ProducerSpool.identity(spool, 7, b"secret", explicit_id=None, explicit_secret=None) == (
        7,
        b"secret",
    )
    spool.close()
    spool = Spool(tmp_path, 1 << 20)
    try:
        assert ProducerSpool.identity(spool, 99, b"", explicit_id=None, explicit_secret=None) == (
            7,
            b"secret",
        )
        with pytest.raises(ValueError, match="belongs to producer id 7, not 8"):
            ProducerSpool.identity(spool, 8, b"", explicit_id=8, explicit_secret=None)
        with pytest.raises(ValueError, match="producer_secret is not the one"):
            ProducerSpool.identity(spool, 7, b"x", explicit_id=7, explicit_secret=b"x")
    finally:
        spool.close()


def test_what_a_give_up_spools_is_replayed_under_its_sequences(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20)
    spool.write_identity(7, b"")
    spooling = ProducerSpool(spool)
    numbered = OpenBatchStream("numbered")
    numbered.resume(100, 0, 0.0)  # the gateway said where our sequence resumes
    take(numbered, b"a")
    numbered.seal()
    take(numbered, b"b")  # still open when the producer gives up
    unknown = OpenBatchStream("unknown")  # never bound: no sequence known
    take(unknown, b"c")
    spooling.spool_everything([numbered, unknown])
    assert spooling.records_spooled == {"numbered": 2, "unknown": 1}
    spool.close()

    spool = Spool(tmp_path, 1 << 20)
    try:
        replayed: dict[str, OpenBatchStream] = {}

        def stream(name: str) -> OpenBatchStream:
            return replayed.setdefault(name, OpenBatchStream(name))

        ProducerSpool(spool).replay(stream, 5.0)
        first = replayed["numbered"].queue
        assert [(b.first_sequence, b.count, b.spooled) for b in first] == [
            (100, 1, True),
            (101, 1, True),
        ]
        assert [decode_records(b.block).to_lists()[0] for b in first] == [[b"a"], [b"b"]]
        (later,) = replayed["unknown"].queue
        assert later.first_sequence < 0 and later.spooled and later.opened_at == 5.0
    finally:
        spool.close()


def test_a_batch_waits_for_room_until_an_ack_frees_some(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 8 * 1024)
    spool.write_identity(7, b"")
    spooling = ProducerSpool(spool)
    s = OpenBatchStream("s")
    s.resume(0, 0, 0.0)
    waited = []
    for i in range(8):
        s.enqueue(encode_records([b"%d" % i + b"x" * 1500]), 1, None, 0.0)
        batch = s.queue[-1]
        if not spooling.room(s, batch, [s]):
            waited.append(i)
            break
        s.number(batch)
        spooling.write(s, batch)
    assert waited, "an 8 KiB spool cannot take 8 batches of 1.5 KiB"
    assert spooling.waiting == [s] and spooling.full == 1
    assert not spooling.room(s, s.queue[-1], [s]), "nothing acknowledged yet"
    assert spooling.full == 1, "one wait, counted once"
    # The gateway acknowledges what was spooled: the stream may try again.
    assert spooling.acked(s, waited[0]) == [s] and spooling.waiting == []
    s.stored_end = waited[0]
    assert spooling.room(s, s.queue[-1], [s])
    spool.close()
