"""Who gets in: tokens with rights, TLS and mutual TLS, against a real gateway.

Each refusal is checked three ways: the peer is told (the documented error
code), the gateway logs it once with the peer's address and never the token,
and nothing is written to any stream.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.client import (
    ClientSecurity,
    Producer,
    ProducerError,
    SessionRefused,
    StreamRefused,
    SyncProducer,
)
from headgate.client.tls import client_context
from headgate.config import ConfigError, load_gateway_config
from headgate.gateway import Gateway
from headgate.gateway.auth import Rights, TokenTable, generate_token, hash_token, load_tokens
from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode
from headgate.protocol.frames import SendChannel, SendGlobal
from headgate.protocol.records import encode_records
from tests.gateway._certs import Authority, make_authority
from tests.gateway._tokens import Token, write_tokens
from tests.helpers import config, stored

pytestmark = pytest.mark.timeout(60)

WRITER = "w-" + "a" * 40
READER = "r-" + "b" * 40
ADMIN = "x-" + "c" * 40


def tokens_file(path: Path) -> Path:
    write_tokens(
        path,
        Token("writer", WRITER, write=("ok-*", "events")),
        Token("reader", READER, read=("*",)),
        Token("admin", ADMIN, write=("*",), read=("*",), admin=True),
    )
    return path


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return make_authority(tmp_path_factory.mktemp("pki"), "headgate")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return make_authority(tmp_path_factory.mktemp("pki-other"), "stranger")


@pytest.fixture
async def auth_gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    gw = Gateway(config(tmp_path, auth_file=tokens_file(tmp_path / "tokens.toml")))
    await gw.start()
    yield gw
    await gw.stop()


async def hello_exchange(address: tuple[str, int], token: bytes) -> list[m.GlobalMessage]:
    """Send Hello with ``token``; return every global message until the gateway closes."""
    reader, writer = await asyncio.open_connection(*address)
    hello = m.Hello(producer_id=7, client_name="raw", token=token)
    writer.write(encode_frame(SendGlobal(payload=m.encode_message(hello))))
    data = await asyncio.wait_for(reader.read(), 10)  # until EOF: the gateway closes
    writer.close()
    frames = FrameDecoder(max_payload=1 << 20).feed(data)
    return [m.decode_global(f.payload) for f in frames if isinstance(f, SendGlobal)]


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "headgate.gateway" and r.levelno >= logging.WARNING
    ]


# -- the tokens table ------------------------------------------------------------


def test_rights_match_whole_names_by_pattern_and_case() -> None:
    rights = Rights(name="t", write=("sensor-*", "clicks"), read=("*",))
    assert rights.can_write("sensor-1") and rights.can_write("clicks")
    assert not rights.can_write("clicks2") and not rights.can_write("Sensor-1")
    assert rights.can_read("anything") and not rights.can_administer()


def test_a_token_authenticates_by_its_hash_only() -> None:
    token = generate_token()
    assert len(token) >= 43
    table = TokenTable([(hash_token(token.encode()), Rights(name="t"))])
    found = table.authenticate(token.encode())
    assert found is not None and found.name == "t"
    assert table.authenticate(token.encode()[:-1]) is None
    assert table.authenticate(hash_token(token.encode()).encode()) is None
    assert table.authenticate(b"") is None
    assert TokenTable([]).authenticate(b"x") is None


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('[[token]]\nsha256 = "abc"\n', "64 hex digits"),
        (f'[[token]]\nsha256 = "{"0" * 64}"\nwrite = 3\n', "list of stream name patterns"),
        (f'[[token]]\nsha256 = "{"0" * 64}"\nadmin = "yes"\n', "true or false"),
        (f'[[token]]\nsha256 = "{"0" * 64}"\nwrites = []\n', "unknown key"),
        (f'[[token]]\nsha256 = "{"0" * 64}"\n[[token]]\nsha256 = "{"0" * 64}"\n', "twice"),
        ("token = 1\n", "array of tables"),
        ("[[token\n", "not valid TOML"),
    ],
)
def test_a_bad_tokens_file_is_a_clear_config_error(
    tmp_path: Path, text: str, complaint: str
) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=complaint):
        load_tokens(path)


def test_headgate_token_prints_an_entry_that_lets_its_token_in(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["token", "--name", "ingest", "--write", "sensor-*", "--read", "sensor-*"]
    )
    assert result.exit_code == 0, result.output
    secret = result.stderr.split(": ")[-1].strip()
    assert secret not in result.stdout
    path = tmp_path / "tokens.toml"
    path.write_text(result.stdout)
    rights = load_tokens(path).authenticate(secret.encode())
    assert rights is not None and rights.name == "ingest"
    assert rights.can_write("sensor-9") and not rights.can_write("other")
    assert not rights.can_administer()


# -- authentication on the wire ----------------------------------------------------


@pytest.mark.parametrize("token", [b"", b"wrong-token-123", WRITER.encode()[:-1]])
async def test_a_peer_that_fails_authentication_gets_one_error_and_is_closed(
    auth_gateway: Gateway, tmp_path: Path, caplog: pytest.LogCaptureFixture, token: bytes
) -> None:
    caplog.set_level(logging.WARNING, logger="headgate.gateway")
    messages = await hello_exchange(auth_gateway.address, token)
    assert len(messages) == 1
    error = messages[0]
    assert isinstance(error, m.Error) and error.code is ErrorCode.UNAUTHENTICATED
    assert error.scope is None
    logged = refusals(caplog)
    assert len(logged) == 1 and "authentication failed" in logged[0]
    assert "127.0.0.1:" in logged[0]
    if token:
        assert token.decode() not in caplog.text
    assert not (tmp_path / "data" / "streams").exists() or not any(
        (tmp_path / "data" / "streams").iterdir()
    )


async def test_a_bad_hello_with_binds_and_batches_behind_it_gets_one_frame_and_stores_nothing(
    auth_gateway: Gateway, tmp_path: Path
) -> None:
    reader, writer = await asyncio.open_connection(*auth_gateway.address)
    hello = m.Hello(producer_id=7, client_name="raw", token=b"bad")
    bind = SendChannel(channel=0, payload=m.encode_message(m.BindStream(stream="events")))
    batch = SendChannel(channel=2, payload=m.encode_batch_header(0) + encode_records([b"x"]))
    writer.write(
        encode_frame(SendGlobal(payload=m.encode_message(hello)))
        + encode_frame(bind)
        + encode_frame(batch)
    )
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    frames = FrameDecoder(max_payload=1 << 20).feed(data)
    assert len(frames) == 1 and isinstance(frames[0], SendGlobal)
    error = m.decode_global(frames[0].payload)
    assert isinstance(error, m.Error) and error.code is ErrorCode.UNAUTHENTICATED
    assert not any((tmp_path / "data" / "streams").iterdir())


async def test_a_producer_with_a_wrong_token_gives_up_at_once_and_writes_nothing(
    auth_gateway: Gateway, tmp_path: Path
) -> None:
    producer = Producer(
        auth_gateway.address, security=ClientSecurity(token="nope"), reconnect_timeout=5
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(SessionRefused, match="UNAUTHENTICATED") as refused:
        await producer.connect()
    assert refused.value.code is ErrorCode.UNAUTHENTICATED
    assert loop.time() - started < 3  # not retried: a token does not get better
    await producer.abort()
    assert not any((tmp_path / "data" / "streams").iterdir())


async def test_a_stream_without_the_write_right_is_refused_and_the_others_flow(
    auth_gateway: Gateway, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="headgate.gateway")
    async with Producer(
        auth_gateway.address, security=ClientSecurity(token=WRITER), reconnect_timeout=5
    ) as producer:
        for i in range(50):
            await producer.send("ok-1", b"fine-%d" % i)
            await producer.send("secret", b"nope-%d" % i)
        with pytest.raises(StreamRefused) as refused:
            await producer.flush("secret")
        assert refused.value.code is ErrorCode.FORBIDDEN and refused.value.stream == "secret"
        for i in range(50, 100):
            await producer.send("ok-1", b"fine-%d" % i)
        await producer.flush("ok-1")
        with pytest.raises(StreamRefused):
            await producer.send("secret", b"again")
    values = [v for _, _, vs in stored(tmp_path / "data", "ok-1") for v in vs]
    assert values == [b"fine-%d" % i for i in range(100)]
    assert not (tmp_path / "data" / "streams" / "secret").exists()
    logged = [line for line in refusals(caplog) if "secret" in line]
    assert len(logged) == 1 and "FORBIDDEN" in logged[0] and "127.0.0.1:" in logged[0]
    assert WRITER not in caplog.text


async def test_a_token_with_only_read_rights_cannot_write(
    auth_gateway: Gateway, tmp_path: Path
) -> None:
    async with Producer(
        auth_gateway.address, security=ClientSecurity(token=READER), reconnect_timeout=5
    ) as producer:
        await producer.send("events", b"x")
        with pytest.raises(StreamRefused, match="FORBIDDEN"):
            await producer.flush("events")
    assert not (tmp_path / "data" / "streams" / "events").exists()


async def test_release_needs_the_admin_right(auth_gateway: Gateway, tmp_path: Path) -> None:
    async with Producer(
        auth_gateway.address, security=ClientSecurity(token=ADMIN), reconnect_timeout=5
    ) as producer:
        await producer.send("events", b"x" * 100)
        await producer.flush()
    log = auth_gateway.streams["events"].log
    before = log.durable_position
    assert before > 0 and log.release_position == 0
    for token, code in ((WRITER, ErrorCode.FORBIDDEN), (ADMIN, None)):
        reader, writer = await asyncio.open_connection(*auth_gateway.address)
        hello = m.Hello(producer_id=9, client_name="pipeline", token=token.encode())
        release = m.Release(stream="events", position=before)
        writer.write(
            encode_frame(SendGlobal(payload=m.encode_message(hello)))
            + encode_frame(SendGlobal(payload=m.encode_message(release)))
            + encode_frame(SendGlobal(payload=m.encode_message(m.Goodbye(code=ErrorCode.NONE))))
        )
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        messages = [
            m.decode_global(f.payload)
            for f in FrameDecoder(max_payload=1 << 20).feed(data)
            if isinstance(f, SendGlobal)
        ]
        errors = [x.code for x in messages if isinstance(x, m.Error)]
        assert errors == ([] if code is None else [code])
        # Refused: nothing released. Allowed: released, once the position is saved.
        await auth_gateway.consumers_saved()
        assert log.release_position == (0 if code is not None else before)


# -- TLS ---------------------------------------------------------------------------


@pytest.fixture
async def tls_gateway(tmp_path: Path, authority: Authority) -> AsyncIterator[Gateway]:
    gw = Gateway(
        config(
            tmp_path,
            tls_cert=authority.server_cert,
            tls_key=authority.server_key,
            handshake_timeout_ms=1000,
        )
    )
    await gw.start()
    yield gw
    await gw.stop()


async def test_a_producer_verifies_the_gateway_and_sends_over_tls(
    tls_gateway: Gateway, tmp_path: Path, authority: Authority
) -> None:
    context = client_context(ca_file=authority.ca)
    async with Producer(
        tls_gateway.address, security=ClientSecurity(tls_context=context), reconnect_timeout=5
    ) as producer:
        for i in range(200):
            await producer.send("events", b"tls-%d" % i)
        await producer.flush()
    values = [v for _, _, vs in stored(tmp_path / "data", "events") for v in vs]
    assert values == [b"tls-%d" % i for i in range(200)]


async def test_a_gateway_with_an_unknown_certificate_is_refused_by_the_producer(
    tls_gateway: Gateway, tmp_path: Path, stranger: Authority
) -> None:
    context = client_context(ca_file=stranger.ca)
    producer = Producer(
        tls_gateway.address, security=ClientSecurity(tls_context=context), reconnect_timeout=5
    )
    with pytest.raises(ProducerError, match="failed TLS verification"):
        await producer.send("events", b"x")
        await producer.flush()
    await producer.abort()
    # The system trust store does not know a test CA either.
    producer = Producer(
        tls_gateway.address,
        security=ClientSecurity(tls_context=client_context()),
        reconnect_timeout=5,
    )
    with pytest.raises(ProducerError, match="failed TLS verification"):
        await producer.connect()
    await producer.abort()
    assert not any((tmp_path / "data" / "streams").iterdir())


async def test_a_plain_tcp_peer_on_a_tls_listener_is_logged_and_cut_off(
    tls_gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="headgate.gateway")
    # A Hello's first byte reads as an SSLv2 record header announcing 3 KiB,
    # so the handshake waits for bytes that never come: the timeout ends it.
    messages = await asyncio.wait_for(hello_exchange(tls_gateway.address, b""), 10)
    assert messages == []
    # Bytes that are no TLS record at all fail at once.
    reader, writer = await asyncio.open_connection(*tls_gateway.address)
    writer.write(b"\x16\x00\x00\x00\x00" * 4)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    logged = refusals(caplog)
    assert len(logged) == 2, logged
    assert all("TLS handshake failed" in line and "127.0.0.1:" in line for line in logged)
    await asyncio.sleep(0.1)
    assert not tls_gateway.connections


async def test_mutual_tls_refuses_a_producer_without_a_good_client_certificate(
    tmp_path: Path, authority: Authority, stranger: Authority, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="headgate.gateway")
    gw = Gateway(
        config(
            tmp_path,
            tls_cert=authority.server_cert,
            tls_key=authority.server_key,
            tls_client_ca=authority.ca,
        )
    )
    await gw.start()
    try:
        for cert, key in ((None, None), (stranger.client_cert, stranger.client_key)):
            context = client_context(ca_file=authority.ca, cert_file=cert, key_file=key)
            producer = Producer(
                gw.address, security=ClientSecurity(tls_context=context), reconnect_timeout=1
            )
            with pytest.raises(ProducerError):
                await producer.send("events", b"x")
                await producer.flush()
            await producer.abort()
        assert not any((tmp_path / "data" / "streams").iterdir())
        assert any("TLS handshake failed" in line for line in refusals(caplog))
        context = client_context(
            ca_file=authority.ca, cert_file=authority.client_cert, key_file=authority.client_key
        )
        async with Producer(
            gw.address, security=ClientSecurity(tls_context=context), reconnect_timeout=5
        ) as producer:
            await producer.send("events", b"mutual")
            await producer.flush()
        assert [vs for _, _, vs in stored(tmp_path / "data", "events")] == [[b"mutual"]]
    finally:
        await gw.stop()


def test_tls_settings_must_come_in_pairs(tmp_path: Path, authority: Authority) -> None:
    with pytest.raises(ConfigError, match="together"):
        config(tmp_path, tls_cert=authority.server_cert).validate()
    with pytest.raises(ConfigError, match="needs tls_cert"):
        config(tmp_path, tls_client_ca=authority.ca).validate()
    with pytest.raises(ConfigError, match="cannot load"):
        Gateway(config(tmp_path, tls_cert=authority.ca, tls_key=authority.server_key))
    with pytest.raises(ValueError, match="cannot load"):
        client_context(ca_file=tmp_path / "missing.pem")
    assert isinstance(client_context(), ssl.SSLContext)


# -- configuration ------------------------------------------------------------------


def test_security_settings_come_from_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text(
        "[gateway]\n"
        'tls_cert = "c.pem"\ntls_key = "k.pem"\ntls_client_ca = "ca.pem"\n'
        'auth_file = "tokens.toml"\nidle_timeout_ms = 5000\nhandshake_timeout_ms = 250\n'
        'max_write_buffer = "256KiB"\nbind_budget = "4KiB"\nmax_streams = 10\n'
        "streams_per_token = 3\nmax_connections = 7\n"
    )
    cfg = load_gateway_config(path)
    assert cfg.tls_cert == Path("c.pem") and cfg.tls_client_ca == Path("ca.pem")
    assert cfg.auth_file == Path("tokens.toml")
    assert (cfg.idle_timeout_ms, cfg.handshake_timeout_ms) == (5000, 250.0)
    assert (cfg.max_write_buffer, cfg.bind_budget) == (256 * 1024, 4096)
    assert (cfg.max_streams, cfg.streams_per_token, cfg.max_connections) == (10, 3, 7)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("idle_timeout_ms = -1\n", "must not be negative"),
        ("idle_timeout_ms = 1.5\n", "whole number"),
        ("handshake_timeout_ms = 0\n", "must be positive"),
        ('max_write_buffer = "1KiB"\n', "at least 64KiB"),
        ("bind_budget = 10\n", "bind_budget"),
        ("max_streams = 0\n", "at least 1"),
        ("auth_file = 3\n", "expected a path"),
    ],
)
def test_bad_security_settings_are_clear_errors(tmp_path: Path, body: str, fragment: str) -> None:
    path = tmp_path / "gw.toml"
    path.write_text("[gateway]\n" + body)
    with pytest.raises(ConfigError, match=fragment):
        load_gateway_config(path)


async def test_the_blocking_producer_takes_a_token_and_tls(
    tls_gateway: Gateway, tmp_path: Path, authority: Authority
) -> None:
    tls_gateway.tokens = load_tokens(tokens_file(tmp_path / "tokens.toml"))

    def produce() -> None:
        context = client_context(ca_file=authority.ca)
        with SyncProducer(
            tls_gateway.address,
            security=ClientSecurity(token=WRITER, tls_context=context, server_name="localhost"),
        ) as producer:
            for i in range(10):
                producer.send("events", b"sync-%d" % i)
            producer.flush(timeout=10)

    await asyncio.to_thread(produce)
    values = [v for _, _, vs in stored(tmp_path / "data", "events") for v in vs]
    assert values == [b"sync-%d" % i for i in range(10)]
