"""The records block: layout, round trips, and hostile input."""

from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
from unittest import mock

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.protocol import records
from headgate.protocol.errors import ErrorCode, MessageError
from headgate.protocol.records import (
    HAS_KEYS,
    decode_records,
    encode_arrow,
    encode_records,
    validate_records,
)

values_st = st.lists(st.binary(max_size=24), max_size=40)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[bytes], list[bytes | None] | None]:
    values = draw(values_st)
    if not draw(st.booleans()):
        return values, None
    keys = draw(
        st.lists(
            st.one_of(st.none(), st.binary(max_size=12)),
            min_size=len(values),
            max_size=len(values),
        )
    )
    return values, keys


#: Validation runs with numpy and with the standard-library fallback; tests try both.
both_paths = pytest.mark.parametrize("path", ["numpy", "stdlib"])
paths = st.sampled_from(["numpy", "stdlib"])


def checked_by(path: str) -> contextlib.AbstractContextManager[object]:
    if path == "stdlib":
        return mock.patch.object(records, "_numpy", lambda: None)
    return contextlib.nullcontext()


# --- the layout, byte for byte ----------------------------------------------


def test_layout_without_keys() -> None:
    block = encode_records([b"ab", b"", b"cde"])
    assert block == (
        struct.pack("<II", 3, 0)  # count, flags
        + struct.pack("<4i", 0, 2, 2, 5)  # value offsets
        + b"abcde"  # value bytes, no padding when nothing follows
    )


def test_layout_with_keys() -> None:
    block = encode_records([b"ab", b"", b"cde"], [b"k", None, b""])
    assert block == (
        struct.pack("<II", 3, HAS_KEYS)
        + struct.pack("<4i", 0, 2, 2, 5)  # value offsets
        + struct.pack("<4i", 0, 1, 1, 1)  # key offsets: the absent key has length 0
        + bytes([0b101, 0, 0, 0])  # validity bitmap (LSB first), padded to 4
        + b"abcde\0\0\0"  # value bytes, padded to 4
        + b"k"  # key bytes
    )


def test_empty_batch() -> None:
    block = encode_records([])
    assert block == struct.pack("<IIi", 0, 0, 0)
    view = decode_records(block)
    assert view.record_count == 0
    assert view.to_lists() == ([], None)
    values, keys = view.to_arrow()
    assert len(values) == 0 and keys is None


def test_validate_returns_the_record_count() -> None:
    assert validate_records(encode_records([b"a"] * 17, [None] * 17)) == 17


# --- round trips --------------------------------------------------------------


@given(path=paths, batch=batches())
def test_round_trip_through_lists(
    path: str, batch: tuple[list[bytes], list[bytes | None] | None]
) -> None:
    """Whatever is encoded decodes to the same records, keys and absent keys included."""
    with checked_by(path):
        values, keys = batch
        view = decode_records(encode_records(values, keys))
        assert view.record_count == len(values)
        assert view.has_keys == (keys is not None)
        assert view.to_lists() == (values, keys)


@given(batch=batches())
def test_round_trip_through_arrow(batch: tuple[list[bytes], list[bytes | None] | None]) -> None:
    """The Arrow view holds the same records, and Arrow itself finds the arrays valid."""
    values, keys = batch
    got_values, got_keys = decode_records(encode_records(values, keys)).to_arrow()
    got_values.validate(full=True)
    assert got_values.type == pa.binary()
    assert got_values.null_count == 0
    assert got_values.to_pylist() == values
    if keys is None:
        assert got_keys is None
    else:
        assert got_keys is not None
        got_keys.validate(full=True)
        assert got_keys.to_pylist() == keys


@given(
    batch=batches(),
    start=st.integers(0, 5),
    stop=st.integers(0, 5),
    kind=st.sampled_from([pa.binary(), pa.large_binary(), pa.string(), pa.large_string()]),
)
def test_arrow_encoding_equals_list_encoding(
    batch: tuple[list[bytes], list[bytes | None] | None], start: int, stop: int, kind: pa.DataType
) -> None:
    """encode_arrow of any slice of any binary-like array gives the same bytes as encode_records."""
    values, keys = batch
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        values = [v.hex().encode() for v in values]
        keys = None if keys is None else [None if k is None else k.hex().encode() for k in keys]

    def as_array(items: list[bytes] | list[bytes | None]) -> pa.Array:
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            return pa.array([None if i is None else i.decode() for i in items], kind)
        return pa.array(items, kind)

    end = max(start, len(values) - stop)
    value_array = as_array(values)[start:end]
    key_array = None if keys is None else as_array(keys)[start:end]
    expected = encode_records(values[start:end], None if keys is None else keys[start:end])
    assert encode_arrow(value_array, key_array) == expected


def test_arrow_encoding_of_a_chunked_array() -> None:
    chunked = pa.chunked_array([[b"a", b"bb"], [b"ccc"]], pa.binary())
    assert encode_arrow(chunked) == encode_records([b"a", b"bb", b"ccc"])


def test_arrow_view_shares_the_block_memory() -> None:
    block = bytearray(encode_records([b"x" * 100, b"y" * 50], [b"key", None]))
    base = pa.py_buffer(block).address
    values, keys = decode_records(block).to_arrow()
    assert keys is not None
    for buffer in [*values.buffers()[1:], *keys.buffers()]:
        assert buffer is not None
        assert base <= buffer.address < base + len(block)


def test_arrow_encoding_rejects_null_values() -> None:
    with pytest.raises(ValueError, match="nulls"):
        encode_arrow(pa.array([b"a", None]))


def test_encoding_rejects_keys_of_another_length() -> None:
    with pytest.raises(ValueError, match="2 keys for 1 values"):
        encode_records([b"a"], [b"k", b"k"])
    with pytest.raises(ValueError, match="2 keys for 1 values"):
        encode_arrow(pa.array([b"a"]), pa.array([b"k", b"k"]))


def test_arrow_encoding_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="binary or string"):
        encode_arrow(pa.array([1, 2]))
    with pytest.raises(TypeError, match="pyarrow Array"):
        encode_arrow([b"a"])


def test_encoding_refuses_sections_past_int32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "MAX_SECTION_BYTES", 8)
    with pytest.raises(ValueError, match="at most 2 GiB"):
        encode_records([b"x" * 9])
    with pytest.raises(ValueError, match="at most 2 GiB"):
        encode_records([b""], [b"x" * 9])


def test_module_imports_and_validates_without_pyarrow_or_numpy() -> None:
    """The protocol layer needs neither pyarrow nor numpy to check a block."""
    script = (
        "import sys\n"
        "sys.modules['pyarrow'] = None\n"
        "sys.modules['numpy'] = None\n"
        "from headgate.protocol.records import encode_records, validate_records\n"
        "assert validate_records(encode_records([b'a', b'bc'], [None, b'k'])) == 2\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


# --- hostile input ------------------------------------------------------------


def assert_malformed(block: bytes, match: str) -> None:
    with pytest.raises(MessageError, match=match) as caught:
        validate_records(block)
    assert caught.value.code is ErrorCode.MALFORMED_MESSAGE
    with pytest.raises(MessageError):
        decode_records(block)


KEYED = encode_records([b"ab", b"", b"cde"], [b"k", None, b""])
PLAIN = encode_records([b"ab", b"", b"cde"])


def patch(block: bytes, at: int, fmt: str, *values: int) -> bytes:
    out = bytearray(block)
    struct.pack_into(fmt, out, at, *values)
    return bytes(out)


@both_paths
def test_each_inconsistency_is_named(path: str) -> None:
    with checked_by(path):
        check_each_inconsistency()


def check_each_inconsistency() -> None:
    assert_malformed(b"\3\0\0\0", "shorter than the 8-byte header")
    assert_malformed(patch(PLAIN, 4, "<I", 2), "unknown flags 0x2")
    assert_malformed(patch(PLAIN, 0, "<I", 2**32 - 1), "need at least")
    assert_malformed(patch(PLAIN, 0, "<I", 4), "need at least|past the data")
    assert_malformed(patch(PLAIN, 8, "<i", 1), "value offsets start at 1")
    assert_malformed(patch(PLAIN, 12, "<i", 3), "value offsets decrease")
    assert_malformed(patch(PLAIN, 20, "<i", -1), "value offsets decrease")
    assert_malformed(patch(PLAIN, 20, "<i", 6), "past the data")
    assert_malformed(PLAIN + b"\0", "1 trailing bytes")
    assert_malformed(PLAIN[:-1], "past the data")
    assert_malformed(patch(KEYED, 24, "<i", 1), "key offsets start at 1")
    assert_malformed(patch(KEYED, 28, "<i", 2), "key offsets decrease")
    assert_malformed(patch(KEYED, 36, "<i", 2), "past the data")
    assert_malformed(patch(KEYED, 40, "<B", 0b1101), "bits set past the last record")
    assert_malformed(patch(KEYED, 41, "<B", 1), "bitmap padding")
    assert_malformed(patch(KEYED, 49, "<B", 1), "value padding")
    assert_malformed(patch(PLAIN, 4, "<I", HAS_KEYS), "need at least|decrease|past|trailing")


@given(path=paths, block=st.binary(max_size=200))
def test_random_bytes_raise_only_message_error(path: str, block: bytes) -> None:
    with checked_by(path):
        try:
            view = decode_records(block)
        except MessageError:
            return
        values, keys = view.to_arrow()
        values.validate(full=True)
        if keys is not None:
            keys.validate(full=True)
        assert view.to_lists()[0] == values.to_pylist()


@given(path=paths, batch=batches(), data=st.data())
def test_every_truncation_and_extension_is_rejected(
    path: str, batch: tuple[list[bytes], list[bytes | None] | None], data: st.DataObject
) -> None:
    """A block's length is exact: no prefix and no longer block is valid."""
    with checked_by(path):
        block = encode_records(*batch)
        cut = data.draw(st.integers(0, len(block) - 1))
        with pytest.raises(MessageError):
            validate_records(block[:cut])
        extra = data.draw(st.binary(min_size=1, max_size=8))
        with pytest.raises(MessageError):
            validate_records(block + extra)


@given(path=paths, batch=batches(), data=st.data())
def test_any_corrupted_word_is_rejected_or_still_safe(
    path: str, batch: tuple[list[bytes], list[bytes | None] | None], data: st.DataObject
) -> None:
    """Overwriting any 4-byte word either fails validation or leaves a block Arrow accepts.

    Header, offsets, bitmap and padding corruption must be caught; a corrupted
    value or key byte is still a valid (different) block.
    """
    with checked_by(path):
        block = bytearray(encode_records(*batch))
        at = data.draw(st.integers(0, max(0, len(block) - 4)))
        word = data.draw(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 0x80000000, 7]))
        block[at : at + 4] = word.to_bytes(4, "little")[: len(block) - at]
        try:
            view = decode_records(bytes(block))
        except MessageError:
            return
        values, keys = view.to_arrow()
        values.validate(full=True)
        if keys is not None:
            keys.validate(full=True)
        assert len(values) == view.record_count


# --- the small-block fast path ---------------------------------------------------


def test_a_small_block_is_checked_without_numpy() -> None:
    """A one-record batch (the smallest a flood can send) never pays numpy's fixed cost."""

    def no_numpy() -> None:
        raise AssertionError("numpy was asked to check a small block")

    with mock.patch.object(records, "_numpy", no_numpy):
        assert validate_records(encode_records([b"n" * 100])) == 1
        assert validate_records(encode_records([b"x"] * records.SMALL_BLOCK_RECORDS)) == (
            records.SMALL_BLOCK_RECORDS
        )
        assert validate_records(encode_records([])) == 0


@given(batch=batches(), data=st.data())
def test_the_fast_path_agrees_with_the_full_check(
    batch: tuple[list[bytes], list[bytes | None] | None], data: st.DataObject
) -> None:
    """Whatever the bytes, the fast path accepts only what the full check accepts,
    with the same count, and accepts every small keyless block the full check does."""
    block = bytearray(encode_records(*batch))
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, max(0, len(block) - 4)))
        word = data.draw(st.sampled_from([0, 1, 3, 2**31 - 1, 2**32 - 1, 0x80000000]))
        block[at : at + 4] = word.to_bytes(4, "little")[: len(block) - at]
    view = memoryview(bytes(block))
    fast = records._small_block_count(view)
    try:
        full: int | None = records._Layout(view).count
    except MessageError:
        full = None
    if fast is not None:
        assert fast == full
    elif full is not None:
        flags = struct.unpack_from("<I", view, 4)[0]
        assert flags or full > records.SMALL_BLOCK_RECORDS
