"""The producer library: send records on named streams to a headgate gateway.

:class:`Producer` is the asyncio client; :class:`SyncProducer` runs one on a
background thread for code without an event loop. Both keep every record
until the gateway acknowledges it durable, reconnect after a lost connection
and resend without duplicates (the gateway deduplicates by producer id,
stream and sequence number). :class:`FleetProducer` (what
``Producer(cluster=...)`` makes) routes partitioned streams over a fleet of
gateways, one :class:`Producer` per gateway. :class:`ReleaseClient` is the pipeline's side:
it tells a gateway how far Spark has committed each stream. Every client
takes the gateway's address as ``host:port`` or ``unix:PATH``
(:class:`GatewayAddress`) and its token and TLS settings as one
:class:`ClientSecurity`. :class:`Reader` (and :class:`SyncReader`) fetches
stored records and tails a stream live, from a :class:`StartAt` or a position.
"""

from headgate.client.address import GatewayAddress
from headgate.client.control import ReleaseClient, ReleaseStatistics
from headgate.client.delivery import BatchResult, Delivery
from headgate.client.errors import (
    BufferFull,
    PendingBatch,
    ProducerError,
    ProducerGaveUp,
    SessionRefused,
    StreamRefused,
)
from headgate.client.fleet import FleetProducer, FleetStatistics, PartitionUnavailable
from headgate.client.producer import Producer
from headgate.client.producer_options import Policy
from headgate.client.producer_statistics import ProducerStatistics, StreamStatistics
from headgate.client.reader import (
    MissedBatches,
    Reader,
    ReaderError,
    ReaderRefused,
    Subscription,
    SyncReader,
    TailBatch,
)
from headgate.client.security import ClientSecurity, SecurityError
from headgate.client.spool import SpoolError
from headgate.client.sync import SyncProducer
from headgate.protocol.messages import StartAt

__all__ = [
    "BatchResult",
    "BufferFull",
    "ClientSecurity",
    "Delivery",
    "FleetProducer",
    "FleetStatistics",
    "GatewayAddress",
    "MissedBatches",
    "PartitionUnavailable",
    "PendingBatch",
    "Policy",
    "Producer",
    "ProducerError",
    "ProducerGaveUp",
    "ProducerStatistics",
    "Reader",
    "ReaderError",
    "ReaderRefused",
    "ReleaseClient",
    "ReleaseStatistics",
    "SecurityError",
    "SessionRefused",
    "SpoolError",
    "StartAt",
    "StreamRefused",
    "StreamStatistics",
    "Subscription",
    "SyncProducer",
    "SyncReader",
    "TailBatch",
]
