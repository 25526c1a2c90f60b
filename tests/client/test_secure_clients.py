"""The reading clients against a gateway with TLS and a tokens file, on 127.0.0.1.

One gateway serves the module: TLS with a throwaway CA, three tokens (a
writer-admin, a reader of ``open-*``, one with no rights) and an idle timeout
under a second, so every test also shows the clients keep their connections
alive with Pings.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.cli.demo import BackgroundLoop
from headgate.client import FleetProducer, Producer, ReleaseClient, SyncProducer
from headgate.client.reader import MissedBatches, Reader, ReaderError, ReaderRefused, SyncReader
from headgate.client.security import ClientSecurity, SecurityError
from headgate.client.tls import client_context
from headgate.gateway import Gateway
from headgate.gateway.auth import hash_token
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode
from headgate.protocol.records import decode_records
from tests.gateway._certs import Authority, make_authority
from tests.helpers import config

pytestmark = pytest.mark.timeout(60)

ADMIN = "adm-" + "a" * 40
READER = "rdr-" + "b" * 40
NOBODY = "nob-" + "c" * 40
IDLE_MS = 900


class Secured:
    """A TLS gateway with tokens on its own event loop thread."""

    def __init__(self, directory: Path) -> None:
        self.pki: Authority = make_authority(directory / "pki", "clients")
        tokens = directory / "tokens.toml"
        tokens.write_text(
            f'[[token]]\nname = "admin"\nsha256 = "{hash_token(ADMIN.encode())}"\n'
            'write = ["*"]\nread = ["*"]\nadmin = true\n\n'
            f'[[token]]\nname = "reader"\nsha256 = "{hash_token(READER.encode())}"\n'
            'read = ["open-*"]\n\n'
            f'[[token]]\nname = "nobody"\nsha256 = "{hash_token(NOBODY.encode())}"\n'
        )
        self.loop = BackgroundLoop("secured-gateway")
        self.gateway = Gateway(
            config(
                directory,
                tls_cert=self.pki.server_cert,
                tls_key=self.pki.server_key,
                auth_file=tokens,
                idle_timeout_ms=IDLE_MS,
            )
        )
        self.loop.run(self.gateway.start(), 30)
        host, port = self.gateway.address
        self.address = f"{host}:{port}"

    def security(self, token: str | None) -> ClientSecurity:
        return ClientSecurity(
            token=None if token is None else token.encode(), ca_file=str(self.pki.ca)
        )

    def produce(self, stream: str, count: int) -> int:
        """Write ``count`` records as the admin; return the durable end of the log."""

        async def send() -> None:
            async with Producer(
                self.address,
                security=self.security(ADMIN),  # the producer takes the same settings
                max_batch_bytes=512,
                reconnect_timeout=10,
            ) as producer:
                for i in range(count):
                    await producer.send(stream, b"%s-%05d" % (stream.encode(), i))
                await producer.flush()

        self.loop.run(send(), 30)
        end: int = self.log(stream).durable_position
        return end

    def log(self, stream: str) -> Any:
        return self.gateway.streams[stream].log

    def stop(self) -> None:
        self.loop.run(self.gateway.stop(), 30)
        self.loop.stop()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    served = Secured(tmp_path_factory.mktemp("secured"))
    try:
        served.produce("open-a", 400)
        served.produce("hidden", 50)
        yield served
    finally:
        served.stop()


def _values(batches: list[Any]) -> list[bytes]:
    out: list[bytes] = []
    for batch in batches:
        out += decode_records(batch.records).to_lists()[0]
    return out


# -- the settings object ------------------------------------------------------------


def test_client_security_reads_the_token_from_its_source_and_never_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = b"s3cr3t-" + b"z" * 30
    direct = ClientSecurity(token=secret)
    assert direct.token_bytes() == secret and secret.decode() not in repr(direct)
    assert not direct.uses_tls and direct.ssl_context() is None
    monkeypatch.setenv("HG_TEST_TOKEN", " " + secret.decode() + "\n")
    assert ClientSecurity(token_env="HG_TEST_TOKEN").token_bytes() == secret
    file = tmp_path / "token"
    file.write_bytes(secret + b"\n")
    from_file = ClientSecurity(token_file=str(file))
    assert from_file.token_bytes() == secret
    # It travels to Spark executors by pickle, token source included.
    assert pickle.loads(pickle.dumps(from_file)) == from_file
    assert ClientSecurity(server_name="gw").uses_tls
    assert ClientSecurity().token_bytes() == b""


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"token": b"x", "token_env": "A"}, "one way only"),
        ({"token": b"x" * (m.MAX_TOKEN_BYTES + 1)}, "at most"),
        ({"key_file": "k.pem"}, "needs its certificate"),
        ({"token_env": ""}, "non-empty"),
        ({"tls_context": ssl.create_default_context(), "ca_file": "ca.pem"}, "one way only"),
        ({"tls_context": "ca.pem"}, "must be an ssl.SSLContext"),
    ],
)
def test_bad_client_security_settings_are_clear_errors(
    settings: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(SecurityError, match=fragment):
        ClientSecurity(**settings)


def test_client_security_takes_a_text_token_and_a_built_context() -> None:
    assert ClientSecurity(token="abc") == ClientSecurity(token=b"abc")
    assert ClientSecurity(token="abc").token_bytes() == b"abc"
    context = ssl.create_default_context()
    built = ClientSecurity(tls_context=context, server_name="gw")
    assert built.uses_tls and built.ssl_context() is context
    assert "SSLContext" not in repr(built)


@pytest.mark.parametrize("removed", ["token", "ssl", "server_hostname"])
def test_the_clients_take_tokens_and_tls_only_through_security(removed: str) -> None:
    # One way to give them: the keywords that used to override security= are gone.
    value: Any = ssl.create_default_context() if removed == "ssl" else "x"
    makers: list[Callable[[], object]] = [
        lambda: Producer("127.0.0.1:1", **{removed: value}),
        lambda: SyncProducer("127.0.0.1:1", **{removed: value}),
        lambda: Reader("127.0.0.1:1", **{removed: value}),
        lambda: SyncReader("127.0.0.1:1", **{removed: value}),
        lambda: FleetProducer(["127.0.0.1:1"], **{removed: value}),
        lambda: Producer(["127.0.0.1:1"], **{removed: value}),
        lambda: ReleaseClient("127.0.0.1:1", **{removed: value}),
    ]
    for make in makers:
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{removed}'"):
            make()


def test_tls_to_a_unix_socket_is_refused_plainly() -> None:
    tls = ClientSecurity(tls=True)
    with pytest.raises(ReaderError, match=r"Unix socket .* does not speak TLS"):
        Reader("unix:/tmp/gw.sock", security=tls)
    with pytest.raises(SecurityError, match="does not speak TLS"):
        ReleaseClient("unix:/tmp/gw.sock", security=tls)


def test_a_missing_token_source_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HG_NO_SUCH_TOKEN", raising=False)
    with pytest.raises(SecurityError, match=r"HG_NO_SUCH_TOKEN .* not set"):
        ClientSecurity(token_env="HG_NO_SUCH_TOKEN").token_bytes()
    with pytest.raises(SecurityError, match="cannot read the token file"):
        ClientSecurity(token_file=str(tmp_path / "absent")).token_bytes()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecurityError, match="is empty"):
        ClientSecurity(token_file=str(tmp_path / "empty")).token_bytes()
    with pytest.raises(SecurityError, match="cannot load CA file"):
        ClientSecurity(ca_file=str(tmp_path / "absent.pem")).ssl_context()


# -- Reader and SyncReader -----------------------------------------------------------


async def test_a_reader_with_a_read_token_lists_fetches_and_subscribes_over_tls(
    secured: Secured,
) -> None:
    async with Reader(secured.address, security=secured.security(READER)) as reader:
        names = [info.stream for info in await reader.list_streams()]
        assert "open-a" in names and "hidden" not in names  # only what it may read
        batches, end = await reader.fetch_all("open-a", 0)
        assert _values(batches) == [b"open-a-%05d" % i for i in range(400)]
        assert end == secured.log("open-a").durable_position
        subscription = reader.subscribe("open-a", m.StartAt.EARLIEST)
        first = await asyncio.wait_for(anext(subscription), 10)
        assert not isinstance(first, MissedBatches) and first.position == 0
        # Quiet for longer than the idle timeout: the reader's Pings keep it open.
        await asyncio.sleep(IDLE_MS * 1.8 / 1000)
        again, _ = await reader.fetch_all("open-a", 0, batches[0].end_position)
        assert len(again) == 1


async def test_a_reader_without_the_right_gets_forbidden(secured: Secured) -> None:
    async with Reader(secured.address, security=secured.security(READER)) as reader:
        with pytest.raises(ReaderRefused) as refused:
            await reader.fetch_all("hidden", 0)
    assert refused.value.code is ErrorCode.FORBIDDEN
    assert "may not read stream 'hidden'" in str(refused.value)
    async with Reader(secured.address, security=secured.security(NOBODY)) as reader:
        assert await reader.list_streams() == []
        subscription = reader.subscribe("open-a")
        with pytest.raises(ReaderRefused, match="FORBIDDEN"):
            await asyncio.wait_for(anext(subscription), 10)


async def test_a_reader_with_a_bad_token_or_no_ca_is_refused_clearly(secured: Secured) -> None:
    with pytest.raises(ReaderRefused) as refused:
        await Reader(secured.address, security=secured.security("wrong-token")).connect()
    assert refused.value.code is ErrorCode.UNAUTHENTICATED
    with pytest.raises(ReaderError, match="TLS verification of the gateway failed"):
        await Reader(
            secured.address, security=ClientSecurity(token=READER.encode(), tls=True)
        ).connect()
    with pytest.raises(ReaderError, match="HG_NO_SUCH_TOKEN"):
        await Reader(
            secured.address, security=ClientSecurity(token_env="HG_NO_SUCH_TOKEN")
        ).connect()


async def test_the_clients_take_a_tls_context_the_application_built(
    secured: Secured,
) -> None:
    security = ClientSecurity(
        token=READER, tls_context=client_context(ca_file=secured.pki.ca), server_name="localhost"
    )
    async with Reader(secured.address, security=security) as reader:
        assert "open-a" in [info.stream for info in await reader.list_streams()]
    admin = ClientSecurity(token=ADMIN, tls_context=client_context(ca_file=secured.pki.ca))
    async with Producer(secured.address, security=admin, reconnect_timeout=10) as producer:
        await producer.send("ctx-made", b"over a built context")
        await producer.flush()
    assert secured.log("ctx-made").durable_position > 0
    stranger = ClientSecurity(token=READER, tls_context=ssl.create_default_context())
    with pytest.raises(ReaderError, match="TLS verification of the gateway failed"):
        await Reader(secured.address, security=stranger).connect()


def test_a_sync_reader_reconnects_after_sitting_idle(secured: Secured) -> None:
    reader = SyncReader(secured.address, security=secured.security(READER))
    with reader:
        assert len(reader.fetch_all("open-a", 0)[0]) > 1
        # No loop runs between calls, so nothing Pings: past half the idle
        # timeout the next call opens a new connection instead of failing.
        time.sleep(IDLE_MS * 1.5 / 1000)
        batches, _ = reader.fetch_all("open-a", 0)
        assert _values(batches)[-1] == b"open-a-00399"
        assert reader.reconnects == 1


# -- ReleaseClient ----------------------------------------------------------------------


def test_the_release_client_releases_with_an_admin_token_over_tls(secured: Secured) -> None:
    end = secured.produce("rel-ok", 100)
    with ReleaseClient(secured.address, security=secured.security(ADMIN)) as client:
        client.release("rel-ok", end)
        assert client.flush(10)
        # Idle past the gateway's timeout: its Pings keep the session.
        time.sleep(IDLE_MS * 1.5 / 1000)
        assert client.statistics().connections == 1
        assert client.statistics().applied == {"rel-ok": end}
    assert secured.log("rel-ok").release_position == end


def test_a_release_without_admin_is_refused_and_logged(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    end = secured.produce("rel-no", 100)
    caplog.set_level(logging.WARNING, logger="headgate.release")
    with ReleaseClient(secured.address, security=secured.security(READER)) as client:
        client.release("rel-no", end)
        assert client.flush(10)  # settled: refused, not retried forever
        assert client.statistics().refusals == 1
        assert client.statistics().applied == {}
    assert secured.log("rel-no").release_position == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("refused a release" in e and "FORBIDDEN" in e for e in errors), errors
    assert READER not in caplog.text


def test_a_release_client_with_a_bad_token_logs_an_error(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="headgate.release")
    client = ReleaseClient(secured.address, security=secured.security("wrong-token"))
    try:
        client.release("open-a", 1)
        assert not client.flush(0.5)
        assert "UNAUTHENTICATED" in (client.statistics().last_error or "")
    finally:
        assert not client.close(0.1)
    assert any(
        r.levelno >= logging.ERROR and "UNAUTHENTICATED" in r.getMessage() for r in caplog.records
    )


# -- headgate tail ------------------------------------------------------------------------


def test_headgate_tail_with_a_token_over_tls(secured: Secured) -> None:
    args = ["tail", "open-a", "--gateway", secured.address, "--from", "earliest"]
    args += ["--count", "5", "--ca-file", str(secured.pki.ca)]
    runner = CliRunner()
    result = runner.invoke(main, args, env={"HEADGATE_TOKEN": READER})
    assert result.exit_code == 0, result.output
    assert result.stdout_bytes.splitlines() == [b"open-a-%05d" % i for i in range(5)]
    refused = runner.invoke(
        main, [*args[:2], *args[2:]], env={"HEADGATE_TOKEN": NOBODY}, catch_exceptions=False
    )
    assert refused.exit_code == 1
    assert "FORBIDDEN" in refused.output and "Traceback" not in refused.output
    unverified = runner.invoke(
        main, [*args[:-2], "--tls"], env={"HEADGATE_TOKEN": READER}, catch_exceptions=False
    )
    assert unverified.exit_code == 1 and "TLS verification" in unverified.output
    bad_key = runner.invoke(main, [*args, "--key", str(secured.pki.client_key)])
    assert bad_key.exit_code == 2 and "--key needs --cert" in bad_key.output
