"""The producer library: send records on named streams to a headgate gateway.

:class:`Producer` is the asyncio client; :class:`SyncProducer` runs one on a
background thread for code without an event loop. Both keep every record
until the gateway acknowledges it durable, reconnect after a lost connection
and resend without duplicates (the gateway deduplicates by producer id,
stream and sequence number).
"""

from headgate.client.address import GatewayAddress
from headgate.client.errors import ProducerError, StreamRefused
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
    "GatewayAddress",
    "Policy",
    "Producer",
    "ProducerError",
    "ProducerStatistics",
    "StreamRefused",
    "StreamStatistics",
    "SyncProducer",
]
