"""A fleet pipeline declares its consumer on partitions no producer has created yet.

Two gateways of one cluster file run in this process on 127.0.0.1; the
pipeline's declaration (:func:`headgate.spark.releases.declare_consumers`,
no Spark) comes before any producer, as ``headgate run --gateways 3`` and a
pipeline started first both do. Each gateway keeps the declaration, says
nothing above INFO, and each partition starts with the consumer.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from headgate.client.fleet import FleetProducer
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.spark.pipeline import pipeline_config_from_dict
from headgate.spark.releases import declare_consumers
from tests.helpers import free_port, positions, run

pytestmark = pytest.mark.timeout(60)

CLUSTER = """
[gateways.gw1]
address = "127.0.0.1:{gw1}"
[gateways.gw2]
address = "127.0.0.1:{gw2}"
[streams.orders]
partitions = 4
assignment = {{ gw1 = [0, 2], gw2 = [1, 3] }}
"""


def test_a_fleet_pipeline_declares_its_consumer_on_partitions_not_created_yet_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ports = {"gw1": free_port(), "gw2": free_port()}
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(CLUSTER.format(**ports), encoding="utf-8")
    config = pipeline_config_from_dict(
        {"cluster": str(cluster), "data_dir": str(tmp_path / "out"), "streams": {"orders": {}}},
        default_consumer="archive",
    )

    async def scenario() -> None:
        gateways = {
            name: Gateway(
                GatewayConfig(
                    listen=("127.0.0.1", port),
                    data_dir=tmp_path / name,
                    cluster=cluster,
                    cluster_name=name,
                )
            )
            for name, port in ports.items()
        }
        for gw in gateways.values():
            await gw.start()
        try:
            with caplog.at_level(logging.INFO, logger="headgate"):
                declared = await asyncio.to_thread(declare_consumers, config)
            assert declared == {f"orders.p{k}": 0 for k in range(4)}
            loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert loud == []
            async with FleetProducer(cluster=cluster, linger_ms=1) as producer:
                for i in range(40):
                    await producer.send("orders", b"v%d" % i, key=b"k%d" % i)
                await producer.flush()
            for name, partitions in (("gw1", (0, 2)), ("gw2", (1, 3))):
                for k in partitions:
                    assert positions(gateways[name], f"orders.p{k}") == {"archive": 0}
        finally:
            for gw in gateways.values():
                await gw.stop()

    run(scenario(), timeout=40)
