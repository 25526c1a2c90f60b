"""What a producer writes to its spool, when, and what it sends again from it.

The spool (:mod:`headgate.client.spool`) is the files; this module is the
producer's rules for them, apart from its connection:

- **Identity.** A spool belongs to one producer id (and secret): a producer
  opened on a spool that holds batches takes them on; an empty one is
  given ours.
- **Replay.** The batches found there are queued first, under the
  sequences they were spooled with, so the gateway stores each once.
- **Before sending.** A batch is written to the spool before its bytes
  leave (the adapter writes only once the spool's fsync covered them); a
  batch that does not fit waits, with every send, until acknowledgements
  free room (:meth:`ProducerSpool.room`).
- **After an initial Ack.** Batches spooled under numbers the gateway's
  copy contradicts, or under none, are numbered and their stream's files
  rewritten (:meth:`ProducerSpool.respool`).
- **Giving up.** Everything still held is spooled, numbered where the
  sequence is known, for the next producer on the spool
  (:meth:`ProducerSpool.spool_everything`).

Nothing here knows about connections or the event loop; time is an argument.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from headgate.client.open_batch import OpenBatchStream
from headgate.client.producer_core import Batch
from headgate.client.spool import Spool

__all__ = ["ProducerSpool"]

log = logging.getLogger("headgate.producer")


class ProducerSpool:
    """A producer's spool and the rules of its use.

    Args:
        spool: the opened spool.
    """

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        #: Streams whose next batch waits for room in the spool; while any
        #: does, sends wait as they do for ``max_buffered_bytes``.
        self.waiting: list[OpenBatchStream] = []
        #: How many times a batch started waiting for room.
        self.full = 0
        #: Per stream, records this producer wrote (not those found on opening).
        self.records_spooled: dict[str, int] = {}

    @staticmethod
    def identity(
        spool: Spool,
        producer_id: int,
        secret: bytes,
        *,
        explicit_id: int | None,
        explicit_secret: bytes | None,
    ) -> tuple[int, bytes]:
        """The producer id and secret to use on ``spool``: the spool's, or ours written to it.

        Raises:
            ValueError: the spool belongs to another producer id or secret
                than the ones given explicitly.
        """
        directory = spool.directory
        if spool.producer_id is None:
            spool.write_identity(producer_id, secret)
            return producer_id, secret
        if explicit_id is not None and explicit_id != spool.producer_id:
            raise ValueError(
                f"the spool {directory} belongs to producer id {spool.producer_id}, "
                f"not {explicit_id}: leave producer_id out to resume it, or use "
                "another spool"
            )
        if (
            explicit_secret is not None
            and spool.producer_secret
            and explicit_secret != spool.producer_secret
        ):
            raise ValueError(f"producer_secret is not the one the spool {directory} holds")
        return spool.producer_id, spool.producer_secret or secret

    def replay(self, stream: Callable[[str], OpenBatchStream], now: float) -> None:
        """Queue the batches found in the spool, under their sequences, timed from ``now``.

        (When they were first sent is not known.)
        """
        spool = self.spool
        for name, batches in spool.recovered.items():
            s = stream(name)
            for spooled in batches:
                batch = s.adopt(
                    spooled.block, spooled.record_count, None, now, spooled.first_sequence
                )
                batch.spooled = True
        if spool.recovered:
            count = sum(b.record_count for batches in spool.recovered.values() for b in batches)
            log.info("spool %s: %d records to send again", spool.directory, count)

    def room(self, s: OpenBatchStream, batch: Batch, streams: Iterable[OpenBatchStream]) -> bool:
        """Whether the spool can take ``batch`` now; if not, ``s`` waits for room.

        Room is made by dropping what every stream's acknowledgements cover.
        """
        spool = self.spool
        size = len(batch.block)
        if spool.fits(size):
            return True
        acked = {t.name: t.stored_end for t in streams if t.stored_end is not None}
        if spool.reclaim(acked) and spool.fits(size):
            return True
        if not self.waiting:
            self.full += 1
        if s not in self.waiting:
            self.waiting.append(s)
        return False

    def write(self, s: OpenBatchStream, batch: Batch) -> None:
        """Spool ``batch`` of ``s`` (numbered, or not yet) if it is not spooled already.

        Raises:
            OSError: the spool cannot be written.
        """
        if batch.spooled:
            return
        first = None if batch.first_sequence < 0 else batch.first_sequence
        self.spool.append(s.name, first, batch.count, batch.block)
        self._spooled(s, batch)

    def _spooled(self, s: OpenBatchStream, batch: Batch) -> None:
        batch.spooled = True
        self.records_spooled[s.name] = self.records_spooled.get(s.name, 0) + batch.count

    def acked(self, s: OpenBatchStream, next_sequence: int) -> list[OpenBatchStream]:
        """The gateway holds ``s`` below ``next_sequence``; returns the streams that may try again.

        Those are the streams that waited for room in the spool; empty if
        none did.
        """
        self.spool.acked(s.name, next_sequence)
        waiting = self.waiting
        if waiting:
            self.waiting = []
        return waiting

    def respool(self, s: OpenBatchStream, renumbered: int) -> None:
        """After an initial Ack: rewrite the stream's spool files if their numbers no longer hold.

        Batches spooled under numbers the gateway's copy contradicts
        (``renumbered``), or under none, are numbered now and the stream's
        spool files replaced, so that the spool holds what will be sent.
        """
        if not (renumbered or any(b.spooled and b.first_sequence < 0 for b in s.queue)):
            return
        for batch in s.queue:
            s.number(batch)
            if not batch.spooled:
                self._spooled(s, batch)
        self.spool.restart(s.name, [(b.first_sequence, b.count, b.block) for b in s.queue])

    def spool_everything(self, streams: Iterable[OpenBatchStream]) -> None:
        """On giving up: spool every record still held, so that a producer on the spool has them.

        Batches of a stream whose sequence is known are numbered on from it
        (nothing numbered was sent, so the gateway has none of them); the
        others are spooled unnumbered and numbered by the producer that
        resumes. Beyond ``spool_max_bytes`` if need be: they are already
        held in memory, within ``max_buffered_bytes`` per stream.

        Raises:
            OSError: the spool cannot be written.
        """
        for s in streams:
            s.seal()
            if s.next_sequence is not None:
                s.number_all()
            for batch in s.held():
                self.write(s, batch)
        self.spool.sync()
