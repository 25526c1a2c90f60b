"""Write the hand-made seeds of the fuzz corpora (run once; the fuzzers grow them).

python -m tests.fuzz.seeds
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from headgate.protocol import messages as m
from headgate.protocol.codec import encode_frame
from headgate.protocol.errors import ErrorCode
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    IssueGuarantees,
    LimitReceiving,
    LimitSending,
    Plead,
    SendChannel,
    SendGlobal,
)
from headgate.protocol.records import encode_records

CORPUS = Path(__file__).parent / "corpus"


def glob(message: m.GlobalMessage) -> bytes:
    return encode_frame(SendGlobal(payload=m.encode_message(message)))


def producer_side() -> list[bytes]:
    """What a producer sends a gateway (the gateway session's input)."""
    bind = encode_frame(
        SendChannel(channel=0, payload=m.encode_message(m.BindStream(stream="clicks")))
    )
    batch = encode_frame(
        SendChannel(channel=2, payload=m.encode_batch_header(0) + encode_records([b"r1", b"r2"]))
    )
    keyed = encode_frame(
        SendChannel(channel=2, payload=m.encode_batch_header(2) + encode_records([b"v"], [b"k"]))
    )
    free = glob(m.FreeHandle(handle_type=m.HandleType.STREAM, handle=0, mine=True))
    return [
        bind + batch + keyed,
        bind + batch + encode_frame(Absolve(channel=2, amount=10)) + free,
        bind + encode_frame(Apologise(channel=2)) + batch,
        bind + encode_frame(LimitSending(channel=2, bound=100)) + batch + batch,
        bind + bind + free + free,
        glob(m.Ping(nonce=7)) + glob(m.Release(stream="clicks", position=64)),
        glob(m.Goodbye(code=ErrorCode.NONE)),
        glob(m.Subscribe(stream="clicks", start=m.StartAt.EARLIEST)),
        glob(m.Metadata(request_id=1)) + bind + batch,
        encode_frame(
            SendChannel(
                channel=1,
                payload=m.encode_message(m.BindSchema(name="s.v1", text="a INT")),
            )
        ),
        encode_frame(IssueGuarantees(channel=2, amount=4096))
        + encode_frame(Plead(channel=2, target=0)),
    ]


def gateway_side() -> list[bytes]:
    """What a gateway sends a producer (the producer session's input)."""
    return [
        encode_frame(IssueGuarantees(channel=0, amount=4096))
        + encode_frame(IssueGuarantees(channel=2, amount=65536))
        + glob(m.Ack(handle=0, next_sequence=0, durable_position=0)),
        encode_frame(IssueGuarantees(channel=0, amount=100))
        + encode_frame(Plead(channel=0, target=0))
        + encode_frame(AnnounceDropping(channel=2)),
        encode_frame(IssueGuarantees(channel=0, amount=100))
        + encode_frame(LimitReceiving(channel=2, bound=0))
        + glob(
            m.Error(
                code=ErrorCode.FORBIDDEN,
                scope=m.HandleRef(handle_type=m.HandleType.STREAM, handle=0),
            )
        ),
        glob(m.Error(code=ErrorCode.UNAUTHENTICATED)),
        # A fleet: the cluster a gateway runs under, and a partition it does not hold.
        glob(
            m.ClusterMetadata(
                request_id=1,
                gateway="gw1",
                gateways=(
                    m.MetadataGateway(name="gw1", address="10.0.0.1:7878"),
                    m.MetadataGateway(name="gw2", address="10.0.0.2:7878"),
                ),
                streams=(m.MetadataStream(stream="orders", holders=(0, 1, 0, 1)),),
            )
        )
        + glob(
            m.Error(
                code=ErrorCode.WRONG_GATEWAY,
                scope=m.HandleRef(handle_type=m.HandleType.STREAM, handle=0),
                text="gw2",
            )
        ),
        encode_frame(
            SendChannel(
                channel=2,
                payload=m.encode_tail_header(m.TailHeader(0, 4096, 4160, 7, 0))
                + encode_records([b"t"]),
            )
        ),
    ]


#: Every u64 field at its edges (issue 13: one such value once stopped the gateway).
U64_EDGES = (0, 1, 1 << 63, (1 << 64) - 1)


def edge_values() -> tuple[list[bytes], list[bytes]]:
    """Each u64 field at each edge: (what a producer sends, what a gateway sends)."""
    bind = encode_frame(
        SendChannel(channel=0, payload=m.encode_message(m.BindStream(stream="clicks")))
    )
    to_gateway: list[bytes] = []
    to_producer: list[bytes] = []
    for v in U64_EDGES:
        batch = m.encode_batch_header(v) + encode_records([b"r"])
        empty = m.encode_batch_header(v) + encode_records([])
        to_gateway += [
            bind + encode_frame(SendChannel(channel=2, payload=batch)),
            bind + encode_frame(SendChannel(channel=2, payload=empty)),
            # The crash of issue 13: a batch at the last u64 right after a good one.
            bind
            + encode_frame(SendChannel(channel=2, payload=m.encode_batch_header(0) + batch[8:]))
            + encode_frame(SendChannel(channel=2, payload=batch)),
            glob(m.Ping(nonce=v)) + glob(m.Pong(nonce=v)),
            bind + glob(m.FreeHandle(handle_type=m.HandleType.STREAM, handle=v, mine=True)),
            glob(m.FreeHandle(handle_type=m.HandleType.SCHEMA, handle=v, mine=False)),
            glob(m.Release(stream="clicks", position=v)),
            glob(m.Subscribe(stream="clicks", start=v, sample_every=max(v, 1))),
            glob(
                m.Fetch(
                    request_id=v, stream="clicks", start_position=v, end_position=v, max_bytes=v
                )
            ),
            glob(m.ListStreams(request_id=v)),
            glob(m.DescribeStreams(request_id=v)),
            glob(m.Metadata(request_id=v)),
            glob(m.Ack(handle=v, next_sequence=v, durable_position=v)),
            bind + encode_frame(Absolve(channel=2, amount=v)),
            bind + encode_frame(Plead(channel=2, target=v)),
            bind + encode_frame(LimitSending(channel=2, bound=v)),
            encode_frame(IssueGuarantees(channel=v, amount=v)),
            encode_frame(LimitReceiving(channel=v, bound=v)),
            encode_frame(AnnounceDropping(channel=v)) + encode_frame(Apologise(channel=v)),
            encode_frame(SendChannel(channel=v, payload=bytes(12))),
        ]
        to_producer += [
            encode_frame(IssueGuarantees(channel=0, amount=v))
            + glob(m.Ack(handle=v, next_sequence=v, durable_position=v)),
            encode_frame(IssueGuarantees(channel=2, amount=v))
            + encode_frame(Plead(channel=2, target=v)),
            glob(m.Missed(handle=v, count=v))
            + glob(m.FetchDone(request_id=v, next_position=v, batches=v)),
            glob(
                m.Error(
                    code=ErrorCode.PRODUCER_FENCED,
                    scope=m.HandleRef(handle_type=m.HandleType.STREAM, handle=v),
                )
            ),
        ]
    return to_gateway, to_producer


def write(directory: Path, data: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / hashlib.sha1(data).hexdigest()).write_bytes(data)


def main() -> None:
    for split in (0, 3, 16):
        for frames in producer_side():
            write(CORPUS / "decoder", bytes([split]) + frames)
            write(CORPUS / "session", bytes([split, 0]) + frames)
        for frames in gateway_side():
            write(CORPUS / "decoder", bytes([split]) + frames)
            write(CORPUS / "session", bytes([split, 1]) + frames)
    to_gateway, to_producer = edge_values()
    for frames in to_gateway:
        write(CORPUS / "decoder", bytes([0]) + frames)
        write(CORPUS / "session", bytes([16, 0]) + frames)
    for frames in to_producer:
        write(CORPUS / "decoder", bytes([0]) + frames)
        write(CORPUS / "session", bytes([16, 1]) + frames)
    for v in U64_EDGES:
        opening = glob(m.Hello(producer_id=v, client_name="x", secret=b"\xff" * 64))
        write(CORPUS / "session", bytes([0, 2]) + opening + producer_side()[0])
        welcome = m.Welcome(
            version=1,
            server_name="g",
            max_message_size=v,
            idle_timeout_ms=v,
            plead_deadline_ms=v,
            producer_secret=b"\x01" * 64,
        )
        write(CORPUS / "session", bytes([0, 3]) + glob(welcome) + gateway_side()[0])
    hello = glob(m.Hello(producer_id=1, client_name="x", token=b"t"))
    write(CORPUS / "session", bytes([0, 2]) + hello + producer_side()[0])
    write(CORPUS / "decoder", b"\x00\x8f" + b"\xff" * 8)


if __name__ == "__main__":
    main()
