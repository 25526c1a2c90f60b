"""The producer library: send records on named streams to a headgate gateway.

:class:`Producer` is the asyncio client; :class:`SyncProducer` runs one on a
background thread for code without an event loop. Both keep every record
until the gateway acknowledges it durable, reconnect after a lost connection
and resend without duplicates (the gateway deduplicates by producer id,
stream and sequence number). :class:`ReleaseClient` is the pipeline's side:
it tells a gateway how far Spark has committed each stream. Every client
takes the gateway's address as ``host:port`` or ``unix:PATH``
(:class:`GatewayAddress`).
"""

from headgate.client.address import GatewayAddress
from headgate.client.control import ReleaseClient, ReleaseStatistics
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
    "GatewayAddress",
    "Policy",
    "Producer",
    "ProducerError",
    "ProducerStatistics",
    "ReleaseClient",
    "ReleaseStatistics",
    "SessionRefused",
    "StreamRefused",
    "StreamStatistics",
    "SyncProducer",
]
