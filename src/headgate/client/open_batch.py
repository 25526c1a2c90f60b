"""The open batch: the records a stream takes before they are sealed into a batch.

:meth:`~headgate.client.Producer.send` appends a record to its stream's open
batch: plain lists, so that nothing but a list append happens per record.
The batch is cut (sealed: encoded into one records block and queued for
sending, :mod:`headgate.client.producer_core`) when the next record would
take it past the batch limit, when its linger time is up, or when something
needs it to go now (a flush, a send waiting for room). This module holds
that rule and the open batch's size estimate, which the sizes of the records
module give (:func:`~headgate.protocol.records.record_cost`). The linger
timer itself is the adapter's: it only leaves its handle here, to be
cancelled when the batch is sealed some other way.

The open batch lives on the same object as the stream's sealed batches
(:class:`OpenBatchStream` extends
:class:`~headgate.client.producer_core.StreamBatches`), because
``send``'s fast path reads both for every record: one object and its slots,
no attribute lookups in between.
"""

from __future__ import annotations

from typing import Protocol

from headgate.client.batches import Block, keyed_switch_extra
from headgate.client.producer_core import Batch, StreamBatches
from headgate.protocol.records import BLOCK_BASE, KEYED_BLOCK_BASE, encode_records, record_cost

__all__ = ["APPENDED", "CUT", "OPENED", "Cancellable", "OpenBatchStream"]

#: :meth:`OpenBatchStream.append` took the record into the open batch (0, so that
#: a caller tells the common case apart with a plain truth test).
APPENDED = 0
#: It took the record as the first of a new open batch.
OPENED = 1
#: It sealed the open batch first (the record would not fit), then opened the next.
CUT = 2


class Cancellable(Protocol):
    """A timer the adapter armed (an ``asyncio.TimerHandle``)."""

    def cancel(self) -> None: ...


class OpenBatchStream(StreamBatches):
    """One stream's sealed batches, and the open batch that takes its next records."""

    __slots__ = ("keys", "linger", "open_bytes", "opened_at", "values")

    def __init__(self, name: str) -> None:
        super().__init__(name)
        #: The open batch's values, and its keys once a record had one.
        self.values: list[bytes] = []
        self.keys: list[bytes | None] | None = None
        #: The open batch's records block, as its size estimate says it will encode.
        self.open_bytes = BLOCK_BASE
        #: The timer that seals the open batch after its linger time.
        self.linger: Cancellable | None = None
        #: When the open batch's first record was sent (the adapter's clock).
        self.opened_at = 0.0

    @property
    def open_held(self) -> int:
        """Bytes the open batch holds (0 when it is empty), for ``max_buffered_bytes``."""
        return self.open_bytes if self.values else 0

    def append(self, value: bytes, key: bytes | None, limit: int, room: float) -> int:
        """Take a record into the open batch, if the stream's bytes stay within ``room``.

        ``room`` bounds the stream's bytes not acknowledged (its sealed
        batches' and the open batch's) with this record; a record that would
        take the open batch past ``limit`` cuts the batch first, and opens
        the next one.

        Returns :data:`APPENDED`, :data:`OPENED` (the record is the first of
        its batch: arm the linger timer), :data:`CUT` (the batch before was
        sealed, and the record opened the next), or minus the bytes the
        record needs when they do not fit in ``room``, having taken nothing.

        Raises:
            ValueError: the record alone does not fit in a batch of ``limit`` bytes.
        """
        keys = self.keys
        keyed = key is not None or keys is not None
        cost = record_cost(len(value), None if key is None else len(key), keyed=keyed)
        # What the batch's earlier keyless records grow by when this is its
        # first record with a key.
        extra = keyed_switch_extra(len(self.values)) if keyed and keys is None else 0
        if (BLOCK_BASE if key is None else KEYED_BLOCK_BASE) + cost > limit:
            raise ValueError(
                f"a record of {len(value) + len(key or b'')} bytes does not fit in a "
                f"batch of at most {limit} bytes (max_batch_bytes or the "
                "gateway's max_message_size)"
            )
        if self.buffered + self.open_bytes + cost + extra > room:
            return -(cost + extra)
        outcome = APPENDED
        if self.open_bytes + cost + extra > limit:
            self.seal()
            outcome = CUT
            keys = None
            extra = 0 if key is None else keyed_switch_extra(0)
        values = self.values
        if not values and outcome == APPENDED:
            outcome = OPENED
        if keys is None and key is not None:
            keys = self.keys = [None] * len(values)
        if keys is not None:
            keys.append(key)
        values.append(value)
        self.open_bytes += cost + extra
        return outcome

    def seal(self) -> Batch | None:
        """Encode the open batch and queue it for sending; None if it was empty."""
        values = self.values
        if not values:
            return None
        block = encode_records(values, self.keys)
        self.discard_open()
        return self.enqueue(block, len(values), None, self.opened_at)

    def open_block(self) -> Block | None:
        """The open batch encoded, left open (what a give-up hands back); None if empty."""
        if not self.values:
            return None
        return encode_records(self.values, self.keys), len(self.values)

    def discard_open(self) -> None:
        """Empty the open batch and stop its timer (sealed, or refused)."""
        self.values = []
        self.keys = None
        self.open_bytes = BLOCK_BASE
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
