"""The gateway: asyncio server, stream logs, credit from log space, durable acks."""

from headgate.gateway.connection import GatewayConnection
from headgate.gateway.server import AddressInUse, Gateway
from headgate.gateway.streams import GatewayStreamStatistics, Stream, Writer

__all__ = [
    "AddressInUse",
    "Gateway",
    "GatewayConnection",
    "GatewayStreamStatistics",
    "Stream",
    "Writer",
]
