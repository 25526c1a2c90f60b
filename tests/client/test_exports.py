"""What the package exports: one way to reach each public name, and no cost to the gateway."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import headgate
import headgate.client
from headgate.client import producer, reader, sync
from headgate.protocol import messages

CLIENT_API = {
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
}


def test_the_client_package_exports_exactly_its_public_api() -> None:
    assert set(headgate.client.__all__) == CLIENT_API
    assert len(headgate.client.__all__) == len(CLIENT_API)  # no name twice
    for name in CLIENT_API:
        assert getattr(headgate.client, name) is not None


def test_each_export_is_the_object_from_its_one_home() -> None:
    assert headgate.client.Producer is producer.Producer
    assert headgate.client.SyncProducer is sync.SyncProducer
    assert headgate.client.Reader is reader.Reader
    assert headgate.client.MissedBatches is reader.MissedBatches
    assert headgate.client.StartAt is messages.StartAt


def test_the_top_level_names_are_the_clients_own() -> None:
    top = set(headgate.__all__) - {"__version__"}
    assert top <= CLIENT_API
    assert {"Producer", "SyncProducer", "Reader", "SyncReader", "StartAt", "ReleaseClient"} <= top
    for name in top:
        assert getattr(headgate, name) is getattr(headgate.client, name)
    assert set(dir(headgate)) >= set(headgate.__all__)


def test_an_unknown_top_level_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        getattr(headgate, "NoSuchThing")  # noqa: B009


def test_importing_the_package_loads_no_client_module() -> None:
    code = "import sys, headgate; print(any(n.startswith('headgate.client') for n in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


def test_the_producer_options_record_is_the_producers_keyword_options() -> None:
    # SyncProducer takes them as **options: their defaults live only in Producer.
    keywords = {
        name
        for name, parameter in inspect.signature(producer.Producer.__init__).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert set(producer.ProducerOptions.__optional_keys__) == keywords
    sync_keywords = set(inspect.signature(sync.SyncProducer.__init__).parameters)
    assert sync_keywords == {
        "self",
        "address",
        "handoff_records",
        "max_pending_records",
        "connect_timeout",
        "options",
    }
