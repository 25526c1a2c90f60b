"""Snapshots of a producer and its streams, as ``Producer.statistics()`` returns them.

Frozen records with a documented field each, for a metrics layer to read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from headgate.client.address import GatewayAddress
from headgate.client.open_batch import OpenBatchStream
from headgate.client.producer_options import Policy

__all__ = ["ProducerStatistics", "StreamStatistics"]


@dataclass(frozen=True, slots=True)
class StreamStatistics:
    """A snapshot of one stream of a producer."""

    #: The stream name.
    stream: str
    #: Records sent to the gateway at least once.
    records_sent: int
    #: Records the gateway acknowledged durable.
    records_acked: int
    #: Records-block bytes sent at least once.
    bytes_sent: int
    #: Records-block bytes acknowledged.
    bytes_acked: int
    #: Records this producer wrote to its spool (those it found there on
    #: opening are not counted); 0 without a spool.
    records_spooled: int
    #: Records in the open batch, not sealed yet.
    open_records: int
    #: Sealed batches waiting for credit or a connection.
    batches_queued: int
    #: Batches sent and not yet acknowledged.
    batches_in_flight: int
    #: Bytes held for the stream and not yet acknowledged: the records blocks
    #: of its sealed batches plus the open batch's (what max_buffered_bytes bounds).
    buffered_bytes: int
    #: Batches the gateway dropped (optimistic policy) and the session resent.
    batches_dropped: int
    #: The sequence number the next batch gets; None before the first initial Ack.
    next_sequence: int | None
    #: Our guarantees on the stream's channel; None while the stream is not bound.
    guarantees: int | None
    #: Why the gateway refused the stream, or None.
    refused: str | None
    #: The gateway's notice that it cannot store the stream now (its disk is
    #: full), until it sends an Ack or guarantees again; None otherwise.
    #: Records wait, they are not lost.
    storage_full: str | None = None
    #: Send-to-durable-ack latency (seconds) of the latest acknowledged
    #: batches (up to :data:`~headgate.latency.WINDOW_SIZE`, none older than
    #: :data:`~headgate.latency.WINDOW_HORIZON_S`): from the ``send()`` of a
    #: batch's first record (from ``send_many()`` for its batches) to the
    #: arrival of the Ack that made it durable. None before any in the window.
    ack_latency_p50: float | None = None
    ack_latency_p99: float | None = None
    ack_latency_max: float | None = None
    #: How many acknowledged batches those percentiles are over.
    ack_latency_batches: int = 0

    @classmethod
    def of(
        cls,
        s: OpenBatchStream,
        now: float,
        *,
        records_spooled: int,
        guarantees: int | None,
        refused: str | None,
        storage_full: str | None,
    ) -> StreamStatistics:
        """The snapshot of stream ``s``'s batches at ``now`` (the clock its acks were timed on).

        The rest is what the producer knows of the stream beside its batches.
        """
        latency = s.latency.summary(now)
        return cls(
            stream=s.name,
            records_sent=s.records_sent,
            records_acked=s.records_acked,
            records_spooled=records_spooled,
            bytes_sent=s.bytes_sent,
            bytes_acked=s.bytes_acked,
            open_records=len(s.values),
            batches_queued=len(s.queue),
            batches_in_flight=len(s.unacked),
            buffered_bytes=s.buffered + s.open_held,
            batches_dropped=s.batches_dropped,
            next_sequence=s.next_sequence,
            guarantees=guarantees,
            refused=refused,
            storage_full=storage_full,
            ack_latency_p50=None if latency is None else latency.p50,
            ack_latency_p99=None if latency is None else latency.p99,
            ack_latency_max=None if latency is None else latency.max,
            ack_latency_batches=0 if latency is None else latency.count,
        )


@dataclass(frozen=True, slots=True)
class ProducerStatistics:
    """A snapshot of a producer and its streams."""

    #: The producer id the gateway deduplicates by.
    producer_id: int
    #: The gateway's address.
    address: GatewayAddress
    #: The sending policy.
    policy: Policy
    #: Whether a session with the gateway is open now.
    connected: bool
    #: How many times the connection was lost after being open.
    reconnects: int
    #: The last connection problem, or None.
    last_error: str | None
    #: Why the producer gave up, or None while it is working.
    failure: str | None
    #: One snapshot per stream used so far.
    streams: Mapping[str, StreamStatistics]
    #: Bytes the spool's files take on disk; None without a spool.
    spool_bytes: int | None = None
    #: How many times a batch waited because the spool was full.
    spool_full: int = 0
