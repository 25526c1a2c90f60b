"""A gateway of a fleet, in process: what it holds, what it refuses, what it tells."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from headgate.client import Producer, StreamRefused
from headgate.client.fleet import fetch_cluster
from headgate.cluster import load_cluster
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.protocol.errors import ErrorCode
from tests.helpers import free_port, gateway, run

CLUSTER = """
[gateways.gw1]
address = "127.0.0.1:{port}"
[gateways.gw2]
address = "127.0.0.1:1"
[streams.orders]
partitions = 2
assignment = {{ gw1 = [0], gw2 = [1] }}
"""


def test_a_log_the_cluster_assigns_elsewhere_is_kept_warned_and_not_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    cluster = tmp_path / "cluster.toml"

    async def before() -> None:
        # A gateway on its own once held orders.p1 and clicks.
        async with gateway(data) as gw, Producer(gw.address) as p:
            await p.send("orders.p1", b"old")
            await p.send("clicks", b"c")

    port = free_port()
    cluster.write_text(CLUSTER.format(port=port), encoding="utf-8")

    async def after() -> None:
        fleet_gateway = Gateway(
            GatewayConfig(
                listen=("127.0.0.1", port), data_dir=data, cluster=cluster, cluster_name="gw1"
            )
        )
        await fleet_gateway.start()
        try:
            await served(fleet_gateway)
        finally:
            await fleet_gateway.stop()

    async def served(gw: Gateway) -> None:
        async with Producer(gw.address) as p:
            assert gw.name == "gw1"
            # The log stays on disk, unserved: a bind of it names its holder.
            await p.send("orders.p1", b"new")
            with pytest.raises(StreamRefused) as refused:
                await p.flush("orders.p1")
            assert refused.value.code is ErrorCode.WRONG_GATEWAY
            assert "held by gateway gw2 (127.0.0.1:1)" in refused.value.text
            # Its own partition and ordinary streams are served as ever.
            await p.send("orders.p0", b"x")
            await p.send("clicks", b"y")
            await p.flush("orders.p0")
            await p.flush("clicks")
            # Any client learns the assignment from it.
            told = await fetch_cluster([f"127.0.0.1:{gw.address[1]}"])
            assert told.streams == load_cluster(cluster).streams

    run(before())
    with caplog.at_level(logging.WARNING, logger="headgate"):
        run(after())
    warnings = [r.getMessage() for r in caplog.records if "not this gateway's" in r.getMessage()]
    assert len(warnings) == 1
    assert "orders.p1" in warnings[0] and "clicks" not in warnings[0]
    assert (data / "streams" / "orders.p1").is_dir()
