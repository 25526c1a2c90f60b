"""The pipeline's consumers on the gateway: declared before any query, released to after each batch.

Credit: after each committed micro-batch (the last one of a run included),
the pipeline hands the committed end offsets to a :data:`Release`, which
tells the gateway (:class:`GatewayReleases`); the gateway frees that log
space and turns it into guarantees for the stream's producers.

Each stream's releases name a consumer of it (``consumer`` in its table,
see :mod:`headgate.spark.pipeline_config`). :func:`declare_consumers`
declares them before any query runs, so that each holds the log from the
pipeline's start; :func:`release_committed` sends what the checkpoints
record as committed before Spark starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headgate.client.security import ClientSecurity
from headgate.config import ConfigError
from headgate.spark.checkpoints import committed_positions
from headgate.spark.pipeline_config import PipelineConfig, StreamPipeline

__all__ = [
    "GatewayReleases",
    "Release",
    "consumer_settings",
    "declare_consumers",
    "release_committed",
]

#: Where a stream's committed position goes: ``release(stream, position)``.
Release = Callable[[str, int], None]

log = logging.getLogger("headgate.pipeline")


def release_committed(config: PipelineConfig, release: Release) -> dict[str, int]:
    """Release every stream's committed position (:func:`committed_positions`); return them.

    Needs no Spark, so ``headgate pipeline`` calls it before Spark starts
    (about ten seconds on a busy machine): producers held back while the
    pipeline was down get their credit back then, not after the first batch.
    Call it after :func:`check_definitions`: a checkpoint made for another
    definition must not release anything.
    """
    released: dict[str, int] = {}
    for spec in config.streams:
        for stream, position in committed_positions(config.checkpoint(spec.name)).items():
            release(stream, position)
            released[stream] = position
    return released


def consumer_settings(spec: StreamPipeline) -> Any:
    """How the gateway is asked to declare ``spec``'s consumer (``ConsumerSettings``)."""
    from headgate.config import ConsumerSettings

    return ConsumerSettings(
        blocking=spec.blocking, on_data_loss="fail" if spec.fail_on_data_loss else "skip"
    )


class GatewayReleases:
    """The pipeline's releases to its gateway: one release client per consumer.

    A stream's releases name its consumer (``consumer`` in its table). Each
    client declares its consumer before its first Release of a stream on
    each connection, so a stream created after the pipeline started gets
    the consumer too. :meth:`release` is a :data:`Release`: it routes by
    stream, and never waits.
    """

    def __init__(self, config: PipelineConfig) -> None:
        from headgate.client.control import ReleaseClient

        self._clients: dict[tuple[str, Any], Any] = {}
        self._client_of: dict[str, Any] = {}
        if config.cluster is not None:
            self._fleet(config, config.cluster)
            return
        gateway = config.gateway
        if gateway is None:
            raise ValueError("a pipeline without a gateway has nowhere to release")
        for spec in config.streams:
            key = (spec.consumer, consumer_settings(spec))
            if key not in self._clients:
                self._clients[key] = ReleaseClient(
                    gateway,
                    security=config.security,
                    consumer=spec.consumer,
                    declare=key[1],
                )
            self._client_of[spec.name] = self._clients[key]
        #: Where the releases go.
        self.address = next(iter(self._clients.values())).address

    def _fleet(self, config: PipelineConfig, path: Path) -> None:
        """One :class:`~headgate.spark.fleet.FleetReleases` per consumer; each
        partition's release goes to its gateway."""
        from headgate.cluster import load_cluster
        from headgate.spark.fleet import FleetReleases

        cluster = load_cluster(path)
        for spec in config.streams:
            key = (spec.consumer, consumer_settings(spec))
            if key not in self._clients:
                self._clients[key] = FleetReleases(
                    cluster, config.security, consumer=spec.consumer, declare=key[1]
                )
            for partition in cluster.stream(spec.name).partitions:
                self._client_of[partition.name] = self._clients[key]
        self.address = f"the gateways of cluster file {path}"

    def release(self, stream: str, position: int) -> None:
        """Commit ``stream`` (with a cluster: a partition's log) up to ``position``
        for the stream's consumer."""
        self._client_of[stream].release(stream, position)

    def applied(self) -> dict[str, int]:
        """Per stream, the newest position the gateway confirmed having applied."""
        applied: dict[str, int] = {}
        from headgate.spark.fleet import FleetReleases

        for client in self._clients.values():
            applied.update(
                client.applied()
                if isinstance(client, FleetReleases)
                else client.statistics().applied
            )
        return applied

    def close(self, timeout: float = 5.0) -> bool:
        """Flush and close every client; True if the gateway confirmed every release."""
        return all([client.close(timeout) for client in self._clients.values()])


def declare_consumers(config: PipelineConfig, timeout: float = 10.0) -> dict[str, int]:
    """Declare each stream's consumer on the gateway, before any query runs.

    A pipeline must hold the log from its start: a consumer declared only at
    its first Release starts at the oldest position the log still holds, and
    another consumer may have freed the log past where this one's first batch
    reads meanwhile. Returns each declared consumer's committed position, by
    stream (with a cluster: on every partition's gateway, by partition log).
    A stream the gateway has not created yet gets the consumer all the same
    (the gateway keeps the declaration, and the stream starts with it at its
    first record); a gateway from before that refuses it, and the stream is
    skipped (its release client declares the consumer with its first
    Release), as is a gateway that cannot be reached (logged: the same
    happens then).

    Raises:
        ConfigError: the token may not declare the consumer (it needs
            ``admin``, or a ``consume`` pattern matching ``STREAM/CONSUMER``),
            or the consumer exists with other settings.
    """
    import asyncio

    from headgate.client.reader import Reader, ReaderError, ReaderRefused
    from headgate.protocol.errors import ErrorCode

    targets = _consumer_targets(config)
    positions: dict[str, int] = {}

    async def declare(target: _ConsumerTarget) -> None:
        spec = target.spec
        settings = consumer_settings(spec)
        async with Reader(
            target.gateway,
            security=target.security,
            client_name="headgate-pipeline",
            connect_timeout=timeout,
        ) as reader:
            positions[target.log] = await reader.declare_consumer(
                target.log,
                spec.consumer,
                blocking=settings.blocking,
                skip_data_loss=settings.on_data_loss == "skip",
            )

    def run(target: _ConsumerTarget) -> None:
        coroutine = asyncio.wait_for(declare(target), timeout * 2)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(coroutine)
            return
        # Called from a thread with a running event loop: run it beside it.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, coroutine).result()

    for target in targets:
        spec, gateway = target.spec, target.gateway
        try:
            run(target)
        except ReaderRefused as exc:
            if exc.code in (ErrorCode.UNEXPECTED_FRAME, ErrorCode.RECOVERING) and (
                "no stream called" in exc.text or exc.code is ErrorCode.RECOVERING
            ):
                log.info(
                    "stream %s: not on the gateway yet; its consumer is declared "
                    "with its first release",
                    target.log,
                )
                continue
            raise ConfigError(
                f"{config.origin}: streams.{spec.name}: the gateway at {gateway} refused to "
                f"declare consumer {spec.consumer!r} of stream {target.log!r}: {exc.text}"
                + (
                    f" (the token needs admin, or a consume pattern matching "
                    f"{target.log}/{spec.consumer}; or set consumer to one it may use)"
                    if exc.code is ErrorCode.FORBIDDEN
                    else ""
                )
            ) from None
        except (ReaderError, TimeoutError, OSError) as exc:
            log.warning(
                "cannot declare consumer %s of stream %s at the gateway %s now (%s); it is "
                "declared with the first release",
                spec.consumer,
                target.log,
                gateway,
                exc,
            )
    return positions


@dataclass(frozen=True, slots=True)
class _ConsumerTarget:
    """One stream log whose consumer the pipeline declares, and where it is."""

    spec: StreamPipeline
    #: The stream log: the stream itself, or (with a cluster) one partition's.
    log: str
    gateway: str
    security: ClientSecurity


def _consumer_targets(config: PipelineConfig) -> list[_ConsumerTarget]:
    """Every stream log the pipeline's consumers are declared on: each stream on
    the gateway, or each partition on the gateway that holds it."""
    if config.cluster is not None:
        from headgate.cluster import load_cluster
        from headgate.spark.fleet import security_for

        cluster = load_cluster(config.cluster)
        return [
            _ConsumerTarget(
                spec,
                partition.name,
                cluster.gateways[partition.gateway].address,
                security_for(cluster, partition.gateway, config.security),
            )
            for spec in config.streams
            for partition in cluster.stream(spec.name).partitions
        ]
    if config.gateway is None:
        return []
    return [_ConsumerTarget(s, s.name, config.gateway, config.security) for s in config.streams]
