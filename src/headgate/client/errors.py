"""Why a producer could not deliver records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from headgate.protocol.errors import ErrorCode
from headgate.protocol.records import decode_records

__all__ = [
    "BufferFull",
    "PendingBatch",
    "ProducerError",
    "ProducerGaveUp",
    "SessionRefused",
    "StreamRefused",
]


class ProducerError(Exception):
    """Records could not be delivered; the message says to whom and why.

    Raised by every pending and later ``send``, ``send_many`` and ``flush`` once
    the producer gave up (gateway unreachable past ``reconnect_timeout``, the
    session refused, a protocol violation) or was closed.
    """


@dataclass(frozen=True, slots=True)
class PendingBatch:
    """Records a producer held and the gateway had not acknowledged, as they were batched.

    A numbered batch (``first_sequence`` not None) went to the gateway at
    least once under that sequence, so the gateway may have stored it: it
    must be sent again only under the same sequence, by a producer with the
    same id, which :meth:`Producer.resend` does, so that the gateway drops
    it if it has it. A batch never numbered was never sent and may be
    numbered afresh.
    """

    #: The stream the records were sent on.
    stream: str
    #: The sequence of the first record, or None if the batch was never sent.
    first_sequence: int | None
    #: How many records.
    record_count: int
    #: The encoded records block (see :mod:`headgate.protocol.records`).
    block: bytes

    def records(self) -> tuple[list[bytes], list[bytes | None] | None]:
        """The values, and the keys (None when no record has one), decoded."""
        return decode_records(self.block).to_lists()


class ProducerGaveUp(ProducerError):
    """The producer could not reach the gateway within ``reconnect_timeout``.

    It carries every record the gateway had not acknowledged, batch by batch
    with their sequences, and the identity they were numbered under. Some of
    them may be stored already (stored, but the acknowledgement was lost with
    the connection): send them again with a producer of the same id and
    secret and :meth:`Producer.resend`, and the gateway stores each record
    once::

        except ProducerGaveUp as gave_up:
            async with Producer(address, producer_id=gave_up.producer_id,
                                producer_secret=gave_up.producer_secret) as p:
                p.resend(gave_up.pending)

    A producer with a spool has written all of them to it on giving up:
    resume from the spool (a new producer on it), not from ``pending`` as
    well, since batches never numbered would then be numbered twice.
    """

    def __init__(
        self,
        message: str,
        *,
        producer_id: int,
        producer_secret: bytes | None,
        pending: Mapping[str, Sequence[PendingBatch]],
    ) -> None:
        super().__init__(message)
        #: The producer id the pending batches are numbered under.
        self.producer_id = producer_id
        #: The secret that proves the id to a gateway without tokens, or None.
        self.producer_secret = producer_secret
        #: Per stream, its unacknowledged batches in sequence order (numbered
        #: ones first); streams with none are left out.
        self.pending: dict[str, list[PendingBatch]] = {
            stream: list(batches) for stream, batches in pending.items() if batches
        }

    @property
    def pending_records(self) -> int:
        """How many records the pending batches hold."""
        return sum(b.record_count for batches in self.pending.values() for b in batches)


class SessionRefused(ProducerError):
    """The gateway refused the whole session for good (for example a bad token).

    Trying again cannot help: the producer gave up at once.
    """

    def __init__(self, message: str, code: ErrorCode, text: str) -> None:
        super().__init__(message)
        #: The gateway's reason, as an error code (``UNAUTHENTICATED``, ...).
        self.code = code
        #: The gateway's explanation, for people.
        self.text = text


class StreamRefused(ProducerError):
    """The gateway refused one stream; the producer's other streams go on.

    The refused stream's unacknowledged records are lost; its later sends,
    ``send_many`` calls and ``flush(stream)`` raise this again.
    """

    def __init__(self, stream: str, code: ErrorCode, text: str) -> None:
        detail = f": {text}" if text else ""
        super().__init__(f"the gateway refused stream {stream!r} ({code.name}){detail}")
        #: The refused stream.
        self.stream = stream
        #: The gateway's reason, as an error code.
        self.code = code
        #: The gateway's explanation, for people.
        self.text = text


class BufferFull(Exception):
    """``Producer.send_nowait`` took nothing: the stream's buffer is full.

    A stream holds at most ``max_buffered_bytes`` of records the gateway has
    not acknowledged yet; this is the backpressure of a stream whose
    consumer is behind, not a failure, and nothing was lost. Await
    ``Producer.send`` (which waits for room) or try again later. It is not
    a :class:`ProducerError`, which means records cannot be delivered.
    """

    def __init__(self, stream: str, limit: int) -> None:
        super().__init__(
            f"stream {stream!r} already holds max_buffered_bytes ({limit}) that the gateway "
            "has not acknowledged; await send() to wait for room"
        )
        #: The stream whose buffer is full.
        self.stream = stream
        #: Its bound, ``max_buffered_bytes``.
        self.limit = limit
