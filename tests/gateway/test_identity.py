"""A producer id belongs to whoever first wrote with it; sequences are contiguous.

The attacks of issue 13, against a real gateway on loopback: a peer that
learned a victim's producer id (a Fetch shows it) says Hello with it and
(a) sends an empty batch far ahead, so that the victim's next batches would
be taken for duplicates, or (b) forges a record at the victim's next
sequence, so that the victim's real batch would be dropped. Both are refused
with PRODUCER_FENCED, scoped to the stream, and the victim loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from headgate.client import ClientSecurity, Producer, SessionRefused, StreamRefused
from headgate.gateway import Gateway
from headgate.gateway.identity import ProducerOwners, hello_owner
from headgate.log import LogError, StorageError
from headgate.protocol import messages as m
from headgate.protocol.codec import encode_frame
from headgate.protocol.errors import ErrorCode
from headgate.protocol.frames import SendChannel
from headgate.protocol.records import encode_records
from headgate.protocol.session import MessageReceived
from tests.gateway._tokens import Token, write_tokens
from tests.helpers import RawPeer, config, stored

pytestmark = pytest.mark.timeout(60)

VICTIM_ID = 4242
VICTIM_TOKEN = "v-" + "1" * 40
ATTACKER_TOKEN = "a-" + "2" * 40


def tokens_file(path: Path) -> Path:
    return write_tokens(
        path,
        Token("victim", VICTIM_TOKEN, write=("*",)),
        Token("attacker", ATTACKER_TOKEN, write=("*",), read=("*",)),
    )


def raw_batch(handle: int, first_sequence: int, values: list[bytes]) -> bytes:
    """A Batch frame sent whatever the guarantees say (as an attacker would)."""
    payload = m.encode_batch_header(first_sequence) + encode_records(values)
    return encode_frame(SendChannel(channel=m.data_channel(handle), payload=payload))


def scoped(peer: RawPeer, code: ErrorCode) -> list[m.Error]:
    return [e for e in peer.errors() if e.scope is not None and e.code == code]


async def fenced_bind(peer: RawPeer, stream: str) -> int:
    """Bind ``stream`` and wait for the gateway's PRODUCER_FENCED for it."""
    handle = peer.session.bind_stream(stream)
    assert handle is not None
    await peer.send()
    await peer.until(lambda: bool(scoped(peer, ErrorCode.PRODUCER_FENCED)))
    (error,) = scoped(peer, ErrorCode.PRODUCER_FENCED)
    assert error.scope == m.HandleRef(handle_type=m.HandleType.STREAM, handle=handle)
    assert str(VICTIM_ID) in error.text
    assert peer.acked(handle) == -1, "a fenced bind gets no Ack"
    return handle


async def still_open(peer: RawPeer, nonce: int = 99) -> None:
    """The connection goes on after a scoped refusal: a Ping is answered."""
    peer.session.send_global(m.Ping(nonce=nonce))
    await peer.send()
    await peer.until(
        lambda: any(
            isinstance(e, MessageReceived) and e.message == m.Pong(nonce=nonce) for e in peer.events
        )
    )


def victim_values(start: int, count: int) -> list[bytes]:
    return [b"victim-%04d" % i for i in range(start, start + count)]


@pytest.fixture
async def token_gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    gw = Gateway(config(tmp_path, auth_file=tokens_file(tmp_path / "tokens.toml")))
    await gw.start()
    yield gw
    await gw.stop()


@pytest.fixture
async def open_gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    gw = Gateway(config(tmp_path))
    await gw.start()
    yield gw
    await gw.stop()


async def spoof(
    gw: Gateway, data: Path, attack: str, *, victim_token: str | None, attacker: RawPeer
) -> None:
    """Victim writes 10, the attacker attacks, the victim writes 10 more; check the log."""
    victim = Producer(
        gw.address, producer_id=VICTIM_ID, security=ClientSecurity(token=victim_token), linger_ms=1
    )
    async with victim:
        for value in victim_values(0, 10):
            await victim.send("s", value)
        await victim.flush()

        await attacker.connect(gw.address)
        handle = await fenced_bind(attacker, "s")
        if attack == "empty batch far ahead":
            frame = raw_batch(handle, 2**62, [])
        else:  # a forged record at the victim's next sequence
            frame = raw_batch(handle, 10, [b"forged"])
        await attacker.send(frame * 3)
        await still_open(attacker)

        for value in victim_values(10, 10):
            await victim.send("s", value)
        await victim.flush()
    frames = stored(data, "s")
    assert [v for _, _, values in frames for v in values] == victim_values(0, 20)
    assert {producer for producer, _, _ in frames} == {VICTIM_ID}
    await attacker.close()


ATTACKS = ["empty batch far ahead", "forged record at the next sequence"]


@pytest.mark.parametrize("attack", ATTACKS)
async def test_another_token_cannot_write_under_a_victims_producer_id(
    token_gateway: Gateway, tmp_path: Path, attack: str
) -> None:
    attacker = RawPeer(producer_id=VICTIM_ID, token=ATTACKER_TOKEN.encode())
    await spoof(
        token_gateway, tmp_path / "data", attack, victim_token=VICTIM_TOKEN, attacker=attacker
    )
    assert not attacker.secret, "with tokens the token owns the id: Welcome carries no secret"


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("secret", [b"", b"guessed-secret"])
async def test_a_peer_without_the_secret_cannot_write_under_a_victims_producer_id(
    open_gateway: Gateway, tmp_path: Path, attack: str, secret: bytes
) -> None:
    attacker = RawPeer(producer_id=VICTIM_ID, secret=secret)
    await spoof(open_gateway, tmp_path / "data", attack, victim_token=None, attacker=attacker)


async def test_the_fence_text_never_carries_the_secret(open_gateway: Gateway) -> None:
    owner = RawPeer(producer_id=VICTIM_ID)
    await owner.connect(open_gateway.address)
    await owner.bind("s")
    assert len(owner.secret) == 16, "Welcome issued a secret"
    other = RawPeer(producer_id=VICTIM_ID)
    await other.connect(open_gateway.address)
    await fenced_bind(other, "s")
    for peer in (owner, other):
        for error in peer.errors():
            assert owner.secret.hex() not in error.text
            assert other.secret.hex() not in error.text
    assert owner.secret != other.secret
    await owner.close()
    await other.close()


async def test_a_peer_that_only_reads_neither_claims_nor_is_refused_an_id(
    token_gateway: Gateway, tmp_path: Path
) -> None:
    # The attacker's token says Hello with the victim's id and writes nothing
    # (a reader, a release client): no claim is made for it.
    reader = RawPeer(producer_id=VICTIM_ID, token=ATTACKER_TOKEN.encode())
    await reader.connect(token_gateway.address)
    await still_open(reader)
    assert token_gateway.owners.owner(VICTIM_ID) is None
    async with Producer(
        token_gateway.address,
        producer_id=VICTIM_ID,
        security=ClientSecurity(token=VICTIM_TOKEN),
        linger_ms=1,
    ) as victim:
        await victim.send("s", b"mine")
        await victim.flush()
    assert token_gateway.owners.owner(VICTIM_ID) == 'token:"victim"'
    assert [values for _, _, values in stored(tmp_path / "data", "s")] == [[b"mine"]]
    await reader.close()


async def test_a_fenced_stream_reaches_the_application_as_stream_refused(
    open_gateway: Gateway,
) -> None:
    async with Producer(open_gateway.address, producer_id=VICTIM_ID, linger_ms=1) as victim:
        await victim.send("s", b"v")
        await victim.flush()
        thief = Producer(open_gateway.address, producer_id=VICTIM_ID, linger_ms=1)
        async with thief:
            await thief.send("s", b"x")
            with pytest.raises(StreamRefused) as caught:
                await asyncio.wait_for(thief.flush("s"), 10)
            assert caught.value.stream == "s"
            assert caught.value.code == ErrorCode.PRODUCER_FENCED
            assert thief.connected, "the session goes on; only the stream is refused"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_a_producer_keeps_its_id_across_a_gateway_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path, listen=("127.0.0.1", free_port()))
    gw = Gateway(cfg)
    await gw.start()
    producer = Producer(gw.address, producer_id=VICTIM_ID, linger_ms=1, reconnect_timeout=20)
    try:
        await producer.connect()
        for value in victim_values(0, 5):
            await producer.send("s", value)
        await producer.flush()
        secret = producer.producer_secret
        assert secret is not None and len(secret) == 16
        assert "secret" not in repr(producer.statistics()).lower()

        await gw.stop()
        gw = Gateway(cfg)  # the same data directory and port
        await gw.start()
        # The same Producer reconnects, presenting the secret: not fenced.
        for value in victim_values(5, 5):
            await producer.send("s", value)
        await asyncio.wait_for(producer.flush(), 20)
        assert producer.statistics().reconnects >= 1
        assert producer.producer_secret == secret
    finally:
        await producer.abort()

    # A new Producer resumes it from the id and secret (as a spool would),
    # while one without the secret is fenced, even after the restart.
    async with Producer(
        gw.address, producer_id=VICTIM_ID, producer_secret=secret, linger_ms=1
    ) as resumed:
        await resumed.send("s", b"resumed")
        await resumed.flush()
    async with Producer(gw.address, producer_id=VICTIM_ID, linger_ms=1) as stranger:
        await stranger.send("s", b"stolen")
        with pytest.raises(StreamRefused, match="PRODUCER_FENCED"):
            await asyncio.wait_for(stranger.flush("s"), 10)
    await gw.stop()
    values = [v for _, _, vs in stored(tmp_path / "data", "s") for v in vs]
    assert values == [*victim_values(0, 10), b"resumed"]


# -- contiguous sequences -------------------------------------------------------------


@pytest.mark.parametrize("policy", ["credit", "window", "xonxoff"])
@pytest.mark.parametrize(
    ("first_sequence", "values"),
    [(6, [b"gap"]), (2**62, [b"far"]), (6, []), (2**62, []), (2**63 - 1, [b"last"])],
)
async def test_a_batch_that_skips_ahead_is_refused_out_of_sequence(
    tmp_path: Path, first_sequence: int, values: list[bytes], policy: str
) -> None:
    gw = Gateway(config(tmp_path, policy=policy))
    await gw.start()
    try:
        await skip_ahead(gw, tmp_path / "data", first_sequence, values)
    finally:
        await gw.stop()


async def skip_ahead(
    open_gateway: Gateway, data: Path, first_sequence: int, values: list[bytes]
) -> None:
    peer = RawPeer(producer_id=7)
    await peer.connect(open_gateway.address)
    h = await peer.bind("s")
    await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
    for i in range(5):
        assert peer.session.send_batch(h, i, encode_records([b"%d" % i]))
    await peer.send()
    await peer.until(lambda: peer.acked(h) == 5)
    assert peer.session.send_batch(h, first_sequence, encode_records(values))
    await peer.send()
    await peer.until(lambda: peer.closed or bool(peer.errors()))
    assert [e.code for e in peer.errors()] == [ErrorCode.OUT_OF_SEQUENCE]
    assert peer.errors()[0].scope is None
    assert "stream s" in peer.errors()[0].text
    assert peer.acked(h) == 5, "never acknowledged"
    await open_gateway.commit()
    assert [values for _, _, values in stored(data, "s")] == [[b"%d" % i] for i in range(5)]
    await peer.close()


async def test_while_storage_is_held_the_next_sequence_counts_held_batches(
    open_gateway: Gateway, tmp_path: Path
) -> None:
    peer = RawPeer(producer_id=7)
    await peer.connect(open_gateway.address)
    h = await peer.bind("s")
    await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
    stream = open_gateway.streams["s"]
    # The disk fills (as the group commit or a term reservation would find).
    stream.sync_failed(StorageError("no room", stream.log.directory, errno.ENOSPC))
    for i in range(3):
        assert peer.session.send_batch(h, i, encode_records([b"%d" % i]))
    await peer.send()
    await peer.until(lambda: stream.statistics().held_batches == 3)
    assert stream.next_sequence(7) == 3, "held batches count"
    # A resend of a held batch is fine; a batch past the held ones is not.
    assert peer.session.send_batch(h, 1, encode_records([b"1"]))
    assert peer.session.send_batch(h, 4, encode_records([b"gap"]))
    await peer.send()
    await peer.until(lambda: ErrorCode.OUT_OF_SEQUENCE in [e.code for e in peer.errors()])
    codes = [e.code for e in peer.errors()]
    assert codes == [ErrorCode.STORAGE_FULL, ErrorCode.OUT_OF_SEQUENCE]
    assert stream.statistics().held_batches == 4
    stream._sync_failed = False  # the disk has room again
    assert stream.retry_storage()
    await open_gateway.commit()
    assert [values for _, _, values in stored(tmp_path / "data", "s")] == [
        [b"0"],
        [b"1"],
        [b"2"],
    ]
    await peer.close()


async def test_out_of_sequence_reaches_the_application_as_session_refused(
    open_gateway: Gateway,
) -> None:
    # A producer whose own numbering is wrong (here, forced by hand): it
    # gives up with a clear error rather than retrying for ever.
    producer = Producer(open_gateway.address, producer_id=8, linger_ms=1)
    await producer.connect()
    try:
        await producer.send("s", b"a")
        await producer.flush()
        producer._streams["s"].next_sequence = 100
        await producer.send("s", b"b")
        with pytest.raises(SessionRefused) as caught:
            await asyncio.wait_for(producer.flush(), 10)
        assert caught.value.code == ErrorCode.OUT_OF_SEQUENCE
        assert "stream s" in str(caught.value)
        with pytest.raises(SessionRefused):
            await producer.send("s", b"c")
    finally:
        await producer.abort()


# -- the owner table ---------------------------------------------------------------------


def test_claims_are_durable_and_the_first_owner_keeps_the_id(tmp_path: Path) -> None:
    path = tmp_path / "state" / "producers.log"
    owners = ProducerOwners.open(path, limit=10)
    alice, _ = hello_owner("alice", b"")
    assert owners.claim(1, alice) is None
    assert owners.claim(1, alice) is None
    refusal = owners.claim(1, 'token:"mallory"')
    assert refusal is not None and refusal.code == ErrorCode.PRODUCER_FENCED
    again = ProducerOwners.open(path, limit=10)
    assert again.owner(1) == alice
    assert again.claim(1, 'token:"mallory"') is not None
    assert path.read_text() == '1 token:"alice"\n', "one line per claim, nothing else"


def test_a_claim_is_written_at_once_and_made_durable_by_sync_not_by_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """claim() (on the event loop) never fsyncs; sync() (the group commit's thread) does,
    the table file and its new directory entry, and only when a claim waits for it."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "state" / "producers.log"
    owners = ProducerOwners.open(path, limit=10)
    assert owners.durable
    assert owners.claim(1, 'token:"alice"') is None
    assert path.read_text() == '1 token:"alice"\n', "written before the bind is accepted"
    assert synced == [] and not owners.durable
    owners.sync()
    assert synced == [str(path), str(path.parent)] and owners.durable
    owners.sync()
    assert len(synced) == 2, "nothing new: no fsync"
    assert owners.claim(2, 'token:"bob"') is None and not owners.durable
    owners.sync()
    assert synced[2:] == [str(path)] and owners.durable


async def test_a_new_producer_ids_claim_is_durable_before_its_first_ack_and_not_fsynced_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = tmp_path / "data" / "state" / "producers.log"
    on_loop: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(table):
            on_loop.append(threading.current_thread() is threading.main_thread())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    gw = Gateway(config(tmp_path))
    await gw.start()
    try:
        async with Producer(gw.address, producer_id=VICTIM_ID, linger_ms=1) as producer:
            await producer.send("s", b"first")
            await producer.flush()
            # Acknowledged: the id's claim was made durable first, off the loop.
            assert gw.owners.durable and on_loop == [False]
            assert ProducerOwners.open(table, limit=10).owner(VICTIM_ID) is not None
    finally:
        await gw.stop()


def test_a_token_name_cannot_break_a_line_of_the_table(tmp_path: Path) -> None:
    path = tmp_path / "producers.log"
    owner, _ = hello_owner('two\nlines "quoted"', b"")
    assert ProducerOwners.open(path, limit=10).claim(9, owner) is None
    assert path.read_bytes().count(b"\n") == 1
    assert ProducerOwners.open(path, limit=10).owner(9) == owner


def test_a_secret_is_kept_only_as_its_hash(tmp_path: Path) -> None:
    owner, issued = hello_owner(None, b"")
    assert len(issued) == 16
    assert issued.hex() not in owner
    assert hello_owner(None, issued) == (owner, issued), "a presented secret is echoed"
    assert hello_owner(None, b"other")[0] != owner
    owners = ProducerOwners.open(tmp_path / "producers.log", limit=10)
    assert owners.claim(5, owner) is None
    assert issued.hex().encode() not in (tmp_path / "producers.log").read_bytes()


def test_a_torn_last_claim_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "producers.log"
    path.write_bytes(b'1 token:"a"\n2 token:"b"\n3 tok')  # a crash in the third append
    owners = ProducerOwners.open(path, limit=10)
    assert (owners.owner(1), owners.owner(2), owners.owner(3)) == ('token:"a"', 'token:"b"', None)
    owner, _ = hello_owner("c", b"")
    assert owners.claim(3, owner) is None
    assert ProducerOwners.open(path, limit=10).owner(3) == owner
    assert path.read_bytes() == b'1 token:"a"\n2 token:"b"\n3 token:"c"\n'


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'1 token:"a"\ngarbage\n', "line 2"),
        (b"\x00\x00\x00\n", "line 1"),
        (b'1 token:"a"\n1 token:"b"\n', "two owners"),
        (b'-1 token:"a"\n', "line 1"),
        (b"1 token:a\n", "line 1"),
        (b"1 secret:nothex\n", "line 1"),
        (b"\xff\xfe\n", "line 1"),
    ],
)
def test_a_damaged_table_is_a_clear_error(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "producers.log"
    path.write_bytes(content)
    with pytest.raises(LogError, match=problem):
        ProducerOwners.open(path, limit=10)


async def test_a_gateway_with_a_damaged_table_does_not_start(tmp_path: Path) -> None:
    state = tmp_path / "data" / "state"
    state.mkdir(parents=True)
    (state / "producers.log").write_bytes(b"not a claim\n")
    gw = Gateway(config(tmp_path))
    with pytest.raises(LogError, match=r"producers\.log is damaged"):
        await gw.start()


async def test_a_full_table_refuses_new_ids_scoped(tmp_path: Path) -> None:
    gw = Gateway(config(tmp_path, max_producer_ids=1))
    await gw.start()
    try:
        first = RawPeer(producer_id=1)
        await first.connect(gw.address)
        await first.bind("s")
        second = RawPeer(producer_id=2)
        await second.connect(gw.address)
        handle = second.session.bind_stream("s")
        await second.send()
        await second.until(lambda: bool(scoped(second, ErrorCode.RESOURCE_EXHAUSTED)))
        assert "max_producer_ids" in scoped(second, ErrorCode.RESOURCE_EXHAUSTED)[0].text
        assert second.acked(handle or 0) == -1
        await still_open(second)
        await first.close()
        await second.close()
    finally:
        await gw.stop()


async def test_a_newer_connection_of_a_producer_fences_the_older_one(
    open_gateway: Gateway, tmp_path: Path
) -> None:
    """A reconnecting producer's old connection is closed before its resume Ack is sent.

    Otherwise bytes the old connection sent, still undecoded, could be stored
    after the new connection's resume Ack, which would then be stale.
    """
    old = RawPeer(producer_id=VICTIM_ID)
    await old.connect(open_gateway.address)
    old_handle = await old.bind("s")
    await old.send(raw_batch(old_handle, 0, victim_values(0, 5)))
    await old.until(lambda: old.acked(old_handle) == 5)

    new = RawPeer(producer_id=VICTIM_ID, secret=old.secret)
    await new.connect(open_gateway.address)
    new_handle = await new.bind("s")
    assert new.acked(new_handle) == 5, "the resume Ack counts what the old one stored"
    # The old connection is told, and closed.
    await old.until(lambda: any(e.code == ErrorCode.PRODUCER_FENCED for e in old.errors()))
    (fence,) = [e for e in old.errors() if e.code == ErrorCode.PRODUCER_FENCED]
    assert fence.scope is None and "fenced" in fence.text
    # What the old one sends now is not stored; the new one goes on from 5.
    with contextlib.suppress(ConnectionError):
        await old.send(raw_batch(old_handle, 5, [b"stale"]))
    await new.send(raw_batch(new_handle, 5, victim_values(5, 5)))
    await new.until(lambda: new.acked(new_handle) == 10)
    values = [v for _, _, vs in stored(tmp_path / "data", "s") for v in vs]
    assert values == victim_values(0, 10)
    await new.close()


async def test_readers_and_a_first_connection_fence_nobody(open_gateway: Gateway) -> None:
    """Only a second writing connection under the same id fences: a lone producer goes on."""
    producer = Producer(open_gateway.address, producer_id=VICTIM_ID, linger_ms=1)
    async with producer:
        for value in victim_values(0, 20):
            await producer.send("s", value)
        await producer.flush()
        assert producer.statistics().reconnects == 0
