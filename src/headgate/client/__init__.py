"""The producer library: send records on named streams to a headgate gateway.

:class:`Producer` is the asyncio client; :class:`SyncProducer` runs one on a
background thread for code without an event loop. Both keep every record
until the gateway acknowledges it durable, reconnect after a lost connection
and resend without duplicates (the gateway deduplicates by producer id,
stream and sequence number).
"""

from headgate.client.errors import ProducerError, SessionRefused, StreamRefused
from headgate.client.producer import (
    BatchResult,
    Delivery,
    Policy,
    Producer,
    ProducerStatistics,
    StreamStatistics,
)
from headgate.client.sync import SyncProducer

__all__ = [
    "BatchResult",
    "Delivery",
    "Policy",
    "Producer",
    "ProducerError",
    "ProducerStatistics",
    "SessionRefused",
    "StreamRefused",
    "StreamStatistics",
    "SyncProducer",
]
