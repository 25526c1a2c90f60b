"""The NATS JetStream peer of bench/flow.py and bench/ingest.py: what the benches
decide without a server (no nats-server is needed, and none is started here)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses looks the module up by name while the class bodies run.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.fixture
def no_server_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A PATH with no nats-server on it, and bench/ importable (as when run as a script)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(BENCH))
    yield


@pytest.fixture
def natsjs() -> ModuleType:
    return _load("natsjs")


def test_a_server_without_sync_interval_is_run_as_it_is_and_said_less_durable(
    natsjs: ModuleType, tmp_path: Path
) -> None:
    debian = natsjs.parse_version("nats-server: v2.9.10\n")
    assert debian == (2, 9, 10)
    config = natsjs.config_text(4222, tmp_path / "store", debian)
    assert "sync_interval" not in config  # 2.9 refuses the key: it would not start
    assert "listen: 127.0.0.1:4222" in config
    assert "less durable than headgate's" in natsjs.durability(debian)
    assert "fsync every 2 min" in natsjs.durability(debian)


def test_a_server_that_can_fsync_each_write_is_told_to(natsjs: ModuleType, tmp_path: Path) -> None:
    recent = natsjs.parse_version("nats-server: v2.15.1")
    assert recent == (2, 15, 1)
    assert "sync_interval: always" in natsjs.config_text(4222, tmp_path, recent)
    assert "as durable as headgate" in natsjs.durability(recent)
    # Asked to keep the default, it does, and the figure says so.
    assert "sync_interval" not in natsjs.config_text(4222, tmp_path, recent, fsync_each=False)
    assert "less durable" in natsjs.durability(recent, fsync_each=False)
    assert natsjs.parse_version("no version here") is None


def test_a_refusal_is_told_from_an_ack(natsjs: ModuleType) -> None:
    assert natsjs.refusal(b'{"stream":"A","seq":7}') is None
    full = b'{"error":{"code":503,"err_code":10077,"description":"maximum bytes exceeded"}}'
    assert natsjs.refusal(full) == "maximum bytes exceeded"
    assert natsjs.refusal(b"").startswith("unreadable answer")  # no responders: no stream
    assert natsjs.refusal(b"[1]").startswith("unexpected answer")
    assert natsjs.refusal(b'{"stream":"A"}').startswith("no sequence")


def test_flow_skips_the_peer_in_one_line_without_a_server(
    no_server_on_path: None, capsys: pytest.CaptureFixture[str]
) -> None:
    flow = _load("flow")
    timing = flow.Timing.default(quick=True)
    result = asyncio.run(flow.measure("nats", timing))
    assert result.skipped == "skipped: no nats-server on PATH (apt-get install nats-server)"
    given = asyncio.run(flow.measure("nats", timing, "/nowhere/nats-server"))
    assert given.skipped == "skipped: no nats-server at /nowhere/nats-server"
    row = flow.table([result], timing).splitlines()[-1]
    assert row.startswith(f"| NATS JetStream | {result.skipped} |")
    assert capsys.readouterr().out == ""  # nothing started, nothing said on the way


def test_ingest_skips_the_peer_in_one_line_without_a_server(
    no_server_on_path: None, capsys: pytest.CaptureFixture[str]
) -> None:
    ingest = _load("ingest")
    args = argparse.Namespace(nats_server=None, no_nats=False, nats_default_sync=False)
    server, note = ingest._start_nats(args)
    assert server is None
    assert note == "skipped: no nats-server on PATH (apt-get install nats-server)"
    ingest._report_nats({}, {}, {}, note)
    assert capsys.readouterr().out == f"\nNATS JetStream: {note}\n"
    # Without the peer, its workloads are not run at all.
    assert "nats" not in ingest._systems("send", with_nats=False)
    assert ingest._systems("ack-each", with_nats=True) == ("nats",)
    assert ingest._systems("bulk", with_nats=True) == ("headgate", "baseline")
