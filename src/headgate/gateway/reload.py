"""A reload (SIGHUP): what a new configuration may change in a running gateway, and how.

``headgate serve`` reads its file again on SIGHUP and hands the result to
:meth:`Gateway.reconfigure <headgate.gateway.server.Gateway.reconfigure>`,
which is :func:`reconfigure` here. It lives in a room of its own because it
is the one place that says which settings take effect at once (capacities,
retention, XON/XOFF watermarks, the consumers the file declares, and every
setting the gateway reads where it uses it, such as ``max_write_buffer``),
which apply to what comes next (a new window size, to writers that bind
after the reload), and which wait for a restart (the listen address, the
data directory, the log layout, the fleet, and each stream's policy).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

from headgate.config import GatewayConfig, StreamSettings
from headgate.gateway.policies import Flow
from headgate.gateway.streams import Stream
from headgate.protocol.errors import ProtocolError

log = logging.getLogger("headgate.gateway")

#: The settings that keep their running values until a restart: they need a
#: new socket, a new log layout, or a new place in a fleet.
RESTART_ONLY = (
    "listen",
    "unix_socket",
    "data_dir",
    "term_length",
    "max_message_size",
    "cluster",
    "cluster_name",
)


class Reloadable(Protocol):
    """What a reload changes in the gateway."""

    #: The running configuration; the reload replaces it.
    config: GatewayConfig
    streams: dict[str, Stream]

    def flow(self, stream: Stream) -> Flow:
        """The stream's flow-control policy (its settings are updated in place)."""
        ...

    def set_capacity(self, name: str, capacity: int) -> None:
        """Resize a stream now."""
        ...


def reconfigure(gateway: Reloadable, config: GatewayConfig) -> None:
    """Apply a reloaded configuration to the running gateway.

    Capacities and XON/XOFF watermarks change at once; a new window size
    applies to writers that bind after the reload. Settings that need
    a new socket or a new log layout (listen address, data directory,
    term length, maximum message size) and a stream's policy keep their
    running values until a restart; each one that differs is logged.
    """
    config = config.validate()
    old = gateway.config
    for key in RESTART_ONLY:
        if getattr(old, key) != getattr(config, key):
            log.warning("reload: %s changes only at restart", key)
    kept = replace(config, **{key: getattr(old, key) for key in RESTART_ONLY})
    for name, stream in gateway.streams.items():
        flow = gateway.flow(stream)
        settings = kept.flow_for(name)
        if settings.policy != flow.policy:
            log.warning(
                "reload: stream %s keeps policy %s until restart (asked for %s)",
                name,
                flow.policy,
                settings.policy,
            )
            streams = dict(kept.streams)
            streams[name] = replace(streams.get(name, StreamSettings()), policy=flow.policy)
            kept = replace(kept, streams=streams)
            settings = kept.flow_for(name)
        flow.update(settings)
    gateway.config = kept.validate()
    for name, stream in gateway.streams.items():
        # Consumers the reload declares are created now; one whose
        # settings changed keeps its stored ones (the log says so), and
        # one it no longer declares goes at the next start.
        for consumer, wanted in gateway.config.consumers_for(name).items():
            try:
                stream.declare_consumer(consumer, wanted, origin="config")
            except ProtocolError as exc:
                log.warning("reload: %s", exc)
    for name in list(gateway.streams):
        retention = gateway.config.retention_for(name)
        if retention != gateway.streams[name].retention:
            log.info("stream %s: retention %s", name, retention)
            gateway.streams[name].set_retention(retention)
        capacity = gateway.config.stream_capacity_for(name)
        if capacity != gateway.streams[name].capacity:
            log.info("stream %s: capacity %d -> %d", name, gateway.streams[name].capacity, capacity)
            gateway.set_capacity(name, capacity)
