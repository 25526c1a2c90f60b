"""Differential check of messages.py against an older copy of it: same bytes, same refusals.

Run by hand when the codec's code changes shape (issue 16 moved every message
to declared layouts), not by pytest::

    git show <old commit>:src/headgate/protocol/messages.py > /tmp/old_messages.py
    PYTHONPATH=src python tests/protocol/compare_messages_with_old.py /tmp/old_messages.py

For random values of every message (valid ones and ones the encoder must
refuse), both encoders must give the same bytes or the same exception type and
text. For every encoding, its prefixes, and random corruptions of it (and the
fuzz corpus's inputs), both decoders must give equal messages or the same
exception type, code and text. It prints the counts and exits non-zero at the
first difference.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headgate.protocol import messages as new
from headgate.protocol.c64 import U64_MAX
from headgate.protocol.errors import ErrorCode

FUZZ_CORPUS = Path(__file__).resolve().parents[1] / "fuzz" / "corpus"


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_messages", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_messages"] = module
    spec.loader.exec_module(module)
    return module


def convert(value: Any, target: ModuleType) -> Any:
    """The same value built from ``target``'s classes (the two modules' classes differ)."""
    if isinstance(value, ErrorCode):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = getattr(target, type(value).__name__)
        return cls(
            **{f.name: convert(getattr(value, f.name), target) for f in dataclasses.fields(value)}
        )
    if isinstance(value, enum.Enum):
        return getattr(target, type(value).__name__)(value.value)
    if isinstance(value, tuple):
        return tuple(convert(v, target) for v in value)
    return value


def outcome(function: Any, *args: Any) -> tuple[str, Any]:
    try:
        return ("ok", function(*args))
    except Exception as error:
        return ("raised", (type(error).__name__, str(error), getattr(error, "code", None)))


# --- values: valid and invalid -------------------------------------------------

ints = st.one_of(
    st.sampled_from([0, 1, 250, 251, 252, 255, 256, 65535, 65536, 2**32, U64_MAX]),
    st.integers(min_value=0, max_value=U64_MAX),
    st.sampled_from([-1, U64_MAX + 1, new.MAX_TIME_US, new.MAX_TIME_US + 1]),
)
names = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,12}", fullmatch=True),
    st.sampled_from(["a" * 255, "a" * 256, "", "bad name", "é", "default"]),
)
texts = st.one_of(st.text(max_size=12), st.sampled_from(["x" * 255, "x" * 256, "é" * 513]))
blobs = st.one_of(st.binary(max_size=12), st.sampled_from([b"\0" * 64, b"\0" * 65]))
small = st.lists(ints, max_size=3).map(tuple)


def messages() -> st.SearchStrategy[Any]:
    info = st.builds(
        new.StreamInfo,
        stream=names,
        start_position=ints,
        durable_position=ints,
        tail_position=ints,
        term_length=ints,
    )
    return st.one_of(
        st.builds(
            new.Hello,
            version=ints,
            producer_id=ints,
            client_name=texts,
            token=blobs,
            flags=st.sampled_from([new.HelloFlags.NONE, new.HelloFlags.OPTIMISTIC]),
            secret=blobs,
        ),
        st.builds(
            new.Welcome,
            version=ints,
            server_name=texts,
            max_message_size=ints,
            idle_timeout_ms=ints,
            plead_deadline_ms=ints,
            producer_secret=blobs,
        ),
        st.builds(new.Goodbye, code=st.sampled_from(list(ErrorCode)), text=texts),
        st.builds(
            new.Error,
            code=st.sampled_from(list(ErrorCode)),
            scope=st.none()
            | st.builds(
                new.HandleRef, handle_type=st.sampled_from(list(new.HandleType)), handle=ints
            ),
            text=texts,
        ),
        st.builds(new.Ping, nonce=ints),
        st.builds(new.Pong, nonce=ints),
        st.builds(
            new.FreeHandle,
            handle_type=st.sampled_from(list(new.HandleType)),
            handle=ints,
            mine=st.booleans(),
        ),
        st.builds(new.Ack, handle=ints, next_sequence=ints, durable_position=ints),
        st.builds(new.Release, stream=names, position=ints, consumer=names),
        st.builds(
            new.Subscribe,
            stream=names,
            start=st.sampled_from(list(new.StartAt)) | ints,
            sample_every=ints,
        ),
        st.builds(new.Missed, handle=ints, count=ints),
        st.builds(
            new.Fetch,
            request_id=ints,
            stream=names,
            start_position=ints,
            end_position=ints,
            max_bytes=ints,
            consumer=st.none() | names,
        ),
        st.builds(
            new.FetchDone,
            request_id=ints,
            next_position=ints,
            batches=ints,
            skipped_bytes=st.none() | ints,
            skipped_records=st.none() | ints,
        ),
        st.builds(new.ListStreams, request_id=ints),
        st.builds(new.StreamList, request_id=ints, streams=st.lists(info, max_size=3).map(tuple)),
        st.builds(new.DescribeStreams, request_id=ints),
        st.builds(
            new.StreamDescriptions,
            request_id=ints,
            streams=st.lists(
                st.builds(new.StreamDescription, info=info, released_at_us=ints), max_size=3
            ).map(tuple),
        ),
        st.builds(
            new.DeclareConsumer,
            request_id=ints,
            stream=names,
            consumer=names,
            blocking=st.booleans(),
            skip_data_loss=st.booleans(),
        ),
        st.builds(new.ConsumerPosition, request_id=ints, position=ints),
        st.builds(
            new.ResetConsumer,
            request_id=ints,
            stream=names,
            consumer=names,
            to=st.sampled_from(list(new.ResetTo)) | ints | st.builds(new.ResetTime, ints),
        ),
        st.builds(new.DeleteConsumer, request_id=ints, stream=names, consumer=names),
        st.builds(new.ListConsumers, request_id=ints, stream=names),
        st.builds(
            new.ConsumerList,
            request_id=ints,
            consumers=st.lists(
                st.builds(
                    new.ConsumerInfo,
                    consumer=names,
                    position=ints,
                    lag_bytes=ints,
                    lag_ms=ints,
                    blocking=st.booleans(),
                    skip_data_loss=st.booleans(),
                    detached=st.booleans(),
                    idle=st.booleans(),
                    lag_records=st.none() | ints,
                ),
                max_size=3,
            ).map(tuple),
        ),
        st.builds(
            new.CountRecords,
            request_id=ints,
            stream=names,
            positions=small | st.just(tuple(range(65))),
        ),
        st.builds(
            new.RecordCounts,
            request_id=ints,
            epoch=ints,
            counts=st.lists(st.none() | ints, max_size=3).map(tuple) | st.just((None,) * 65),
        ),
        st.builds(new.Metadata, request_id=ints),
        st.builds(
            new.ClusterMetadata,
            request_id=ints,
            gateway=texts,
            gateways=st.lists(
                st.builds(
                    new.MetadataGateway, name=names, address=st.sampled_from(["", "h:1"]) | texts
                ),
                max_size=3,
            ).map(tuple),
            streams=st.lists(
                st.builds(
                    new.MetadataStream,
                    stream=names,
                    holders=st.lists(st.integers(-1, 3), max_size=3).map(tuple),
                ),
                max_size=2,
            ).map(tuple),
        ),
        st.builds(new.BindStream, stream=names),
        st.builds(new.BindSchema, name=names, text=texts),
    )


def decoders(module: ModuleType) -> list[Any]:
    return [module.decode_global, module.decode_bind_stream, module.decode_bind_schema]


def compare_decoding(old: ModuleType, payload: bytes, counts: dict[str, int]) -> None:
    for new_decode, old_decode in zip(decoders(new), decoders(old), strict=True):
        mine = outcome(new_decode, payload)
        theirs = outcome(old_decode, payload)
        if theirs[0] == "ok":
            theirs = ("ok", convert(theirs[1], new))
        assert mine == theirs, (payload.hex(), new_decode.__name__, mine, theirs)
        counts[f"decoded {mine[0]}"] += 1


def main() -> None:
    old = load(sys.argv[1])
    examples = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    counts = {"encoded ok": 0, "encoded raised": 0, "decoded ok": 0, "decoded raised": 0}
    rng = random.Random(16)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(message=messages())
    def check(message: Any) -> None:
        mine = outcome(new.encode_message, message)
        theirs = outcome(old.encode_message, convert(message, old))
        assert mine == theirs, (message, mine, theirs)
        counts[f"encoded {mine[0]}"] += 1
        if mine[0] != "ok":
            return
        encoded: bytes = mine[1]
        payloads = [encoded, encoded + b"\0", *(encoded[:n] for n in range(len(encoded)))]
        for _ in range(8):
            corrupt = bytearray(encoded)
            corrupt[rng.randrange(len(corrupt))] = rng.randrange(256)
            payloads.append(bytes(corrupt))
        for payload in payloads:
            compare_decoding(old, payload, counts)

    check()
    # Inputs with two faults, where only the order of the checks tells which
    # refusal a peer reads (a holder past the gateways, then a truncation).
    gateway = bytes([1]) + b"g" + bytes([3]) + b"h:1"
    for payload in (
        bytes([0x41, 1, 1]) + b"g" + bytes([1]) + gateway + bytes([1, 1]) + b"s" + bytes([2, 5]),
        bytes([0x41, 1, 1]) + b"g" + bytes([1]) + gateway + bytes([1, 1]) + b"s" + bytes([1, 9]),
        bytes([0x29, 0, 1, 1]) + b"a" + bytes([0, 0, 0, 0, 0xFF]) + bytes(8),
    ):
        compare_decoding(old, payload, counts)
    corpus = sorted(FUZZ_CORPUS.rglob("*"))
    for path in corpus:
        if path.is_file():
            data = path.read_bytes()
            for start in range(min(len(data), 24)):
                compare_decoding(old, data[start:], counts)
    print(f"{examples} random messages, {len(corpus)} corpus paths: {counts}; no difference")


if __name__ == "__main__":
    main()
