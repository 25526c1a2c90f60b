"""What a producer that gives up hands over, and what another one takes back.

A producer that gives up (:class:`~headgate.client.ProducerGaveUp`) hands
every record the gateway did not acknowledge to its caller, as the batches
they were sent in (:class:`~headgate.client.PendingBatch`): numbered ones
under the sequences the gateway may have stored them with, then the
unnumbered rest, the open batch last. :meth:`~headgate.client.Producer.resend`
takes such batches back on a producer with the same id, which sends the
numbered ones under their own sequences, so that the gateway stores each
record once. This module is both halves' rules, without I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from headgate.client.errors import PendingBatch
from headgate.client.open_batch import OpenBatchStream
from headgate.client.producer_core import check_resend_order

__all__ = ["pending_of", "resend_by_stream"]


def pending_of(s: OpenBatchStream) -> list[PendingBatch]:
    """Stream ``s``'s records not acknowledged, as batches, in sequence order.

    The open batch comes last, encoded and unnumbered (it was never sent).
    """
    batches = [
        PendingBatch(s.name, None if b.first_sequence < 0 else b.first_sequence, b.count, b.block)
        for b in s.held()
    ]
    open_block = s.open_block()
    if open_block is not None:
        block, count = open_block
        batches.append(PendingBatch(s.name, None, count, block))
    return batches


def resend_by_stream(
    pending: Mapping[str, Iterable[PendingBatch]] | Iterable[PendingBatch],
    used: Callable[[str], bool],
) -> dict[str, list[PendingBatch]]:
    """The batches handed back, per stream, checked before any is taken.

    ``pending`` is :attr:`ProducerGaveUp.pending` or its batches in a list;
    ``used`` says whether the taking producer already sent on a stream.

    Raises:
        ValueError: a stream was already used, or its numbered batches are
            out of order or after unnumbered ones (they could not be stored
            exactly once).
    """
    batches: Iterable[PendingBatch]
    if isinstance(pending, Mapping):
        batches = [b for stream_batches in pending.values() for b in stream_batches]
    else:
        batches = list(pending)
    by_stream: dict[str, list[PendingBatch]] = {}
    for batch in batches:
        by_stream.setdefault(batch.stream, []).append(batch)
    for name, stream_batches in by_stream.items():
        if used(name):
            raise ValueError(
                f"stream {name!r} was already used by this producer; resend() must "
                "come before any other send on it"
            )
        check_resend_order(name, ((b.first_sequence, b.record_count) for b in stream_batches))
    return by_stream
