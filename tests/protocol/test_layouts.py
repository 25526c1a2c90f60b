"""The declared message layouts: PROTOCOL.md draws them, and the hand-tuned codecs follow them.

Every message's layout is declared once in messages.py. The control messages
are encoded and decoded from it; the data headers (Batch, TailRecords) keep
their one-``struct``-call codecs, and these tests hold those codecs to the
declaration. PROTOCOL.md's diagrams are read here and compared, field by
field, with what each declaration says (name, order, wire type).
"""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from headgate.protocol import messages as m
from headgate.protocol.c64 import U64_MAX
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.frame_layout import FRAME_LAYOUTS, FrameLayout, frame_layout_of_first_byte
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
from headgate.protocol.layout import Layout, Row

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "PROTOCOL.md"

# A notation as PROTOCOL.md writes it ("Field notation in the diagrams").
_NOTATION = re.compile(r"^(u8|c64|u32le|u64le|i64le|name|text\(\d+\)|bytes\(\d+\))$")
# A title line of a diagram: "Hello: ...", "BindStream, channel 0: ...".
_TITLE = re.compile(r"^([A-Z][A-Za-z]*)[,:]")
# A title line of an entry drawn apart: " stream entry:", " described entry: ...".
_ENTRY_TITLE = re.compile(r"^ ([a-z]+ entry):")
# A cell of repeated entries: "count x stream entry", "count x (a, b [c])".
_REPEATED = re.compile(r"^\w+ x (.*)$")


def _diagram_blocks() -> list[list[str]]:
    """The diagram blocks of the sections that draw messages ("Messages", "Consumers")."""
    whole = PROTOCOL_MD.read_text(encoding="utf-8")
    messages = whole.split("\n## Messages\n", 1)[1].split("\n### The records block\n", 1)[0]
    consumers = whole.split("\n## Consumers\n", 1)[1].split("\n## Worked examples\n", 1)[0]
    text = messages + consumers
    return [block.split("\n") for block in re.findall(r"```\n(.*?)```", text, flags=re.S)]


def _cells(row: str) -> list[tuple[int, int, str]]:
    """``(start column, end column, text)`` of each cell between pipes of a field row."""
    pipes = [i for i, char in enumerate(row) if char == "|"]
    return [(a + 1, b, row[a + 1 : b].strip()) for a, b in pairwise(pipes)]


def _notations(row: str) -> list[tuple[int, str]]:
    """``(column, chunk)`` of each chunk of a notation row (chunks part at 2+ spaces)."""
    return [(found.start(), found.group()) for found in re.finditer(r"\S+(?: \S+)*", row)]


def _drawn_groups(lines: list[str]) -> list[tuple[str, list[Row]]]:
    """Each drawn message in a block: its key (type byte in hex, or title) and its rows."""
    groups: list[tuple[str, list[Row]]] = []
    title = ""
    for number, line in enumerate(lines):
        found = _TITLE.match(line) or _ENTRY_TITLE.match(line)
        if found:
            title = found.group(1)
        is_field_row = line.strip().startswith("|") and line.strip().endswith("|")
        if not is_field_row or number + 2 >= len(lines):
            continue
        notations = _notations(lines[number + 2])
        current: list[Row] | None = None
        if not re.fullmatch(r"[0-9a-f]{2}", _cells(line)[0][2]):
            current = []
            groups.append((title, current))
        for start, end, cell in _cells(line):
            words = [
                word
                for column, word in notations
                if start <= column < end
                and (_NOTATION.match(word.split()[0]) or word.endswith(" x"))
            ]
            if not cell:
                continue  # the gap between two diagrams drawn side by side
            if re.fullmatch(r"[0-9a-f]{2}", cell):
                current = [(cell, "u8")]
                groups.append((cell, current))
                continue
            assert current is not None
            repeated = _REPEATED.match(cell)
            if repeated or any(word.endswith(" x") for word in words):
                names = re.findall(r"[a-z_]+", repeated.group(1)) if repeated else []
                kinds = [word.split()[0] for word in words if _NOTATION.match(word.split()[0])]
                drawn = list(zip(names, kinds, strict=True)) if kinds else None
                current.append(("*", drawn))
            elif not words and "records block" in cell:
                continue  # records.py's, after the header
            elif not words and title.endswith(" entry"):
                current.append((cell, None))  # "as above": an entry drawn before
            else:
                assert len(words) == 1, (title, cell, words)
                current.append((cell, words[0].split()[0]))
    return groups


def _drawn() -> dict[str, list[Row]]:
    drawn: dict[str, list[Row]] = {}
    for block in _diagram_blocks():
        for key, rows in _drawn_groups(block):
            if key:
                drawn.setdefault(key, []).extend(rows)
    return drawn


def _comparable(rows: list[Row], drawn: list[Row]) -> list[Row]:
    """The declared rows, with an entry's rows left out where the diagram draws it apart."""
    out: list[Row] = []
    for (name, notation), (_, drawn_notation) in zip(rows, drawn, strict=False):
        if name == "*" and drawn_notation is None:
            out.append(("*", None))
        else:
            out.append((name, notation))
    return out + rows[len(drawn) :]


def _check_drawn(key: str, layout: Layout, drawn: dict[str, list[Row]]) -> None:
    assert key in drawn, f"PROTOCOL.md draws no diagram of {key} ({layout.what})"
    declared = layout.rows()
    assert _comparable(declared, drawn[key]) == drawn[key], layout.what


def test_protocol_md_draws_every_global_message_as_declared() -> None:
    drawn = _drawn()
    for layout in m.GLOBAL_LAYOUTS:
        assert layout.type_byte is not None
        _check_drawn(f"{layout.type_byte:02x}", layout, drawn)


def test_protocol_md_draws_the_channel_messages_and_data_headers_as_declared() -> None:
    drawn = _drawn()
    _check_drawn("BindStream", m.BIND_STREAM_LAYOUT, drawn)
    _check_drawn("BindSchema", m.BIND_SCHEMA_LAYOUT, drawn)
    _check_drawn("Batch", m.BATCH_LAYOUT, drawn)
    _check_drawn("TailRecords", m.TAIL_LAYOUT, drawn)


def test_protocol_md_draws_the_entries_drawn_apart_as_declared() -> None:
    drawn = _drawn()
    stream_list = next(lay for lay in m.GLOBAL_LAYOUTS if lay.cls is m.StreamList)
    assert stream_list.rows()[-1] == ("*", drawn["stream entry"])
    descriptions = next(lay for lay in m.GLOBAL_LAYOUTS if lay.cls is m.StreamDescriptions)
    ((_, entry_rows),) = descriptions.rows()[-1:]
    # "a StreamList stream entry, then one field"
    assert drawn["described entry"] == [("stream entry", None), entry_rows[-1]]
    assert entry_rows[:-1] == drawn["stream entry"]


def test_the_diagram_reader_sees_a_wrong_field() -> None:
    """The check above can fail: a diagram that swaps a type is not what is declared."""
    wrong = [
        " +----+---------+",
        " | 24 | request_id |",
        " +----+---------+",
        "   u8   u64le",
    ]
    ((key, rows),) = _drawn_groups(wrong)
    assert key == "24"
    declared = next(lay for lay in m.GLOBAL_LAYOUTS if lay.type_byte == 0x24).rows()
    assert rows != declared
    assert rows[:1] == declared[:1]


def test_every_message_type_and_class_has_one_layout() -> None:
    type_bytes = [layout.type_byte for layout in m.GLOBAL_LAYOUTS]
    assert sorted(b for b in type_bytes if b is not None) == sorted(int(t) for t in m.MessageType)
    assert None not in type_bytes
    classes = {layout.cls for layout in m.GLOBAL_LAYOUTS}
    assert classes == set(m.GlobalMessage.__args__)


# --- the hand-tuned data headers, held to their declarations --------------------

u64s = st.one_of(
    st.sampled_from([0, 1, 255, 256, 2**32, 2**63 - 1, U64_MAX]), st.integers(0, U64_MAX)
)
u32s = st.integers(0, 2**32 - 1)
i64s = st.integers(-(2**63), 2**63 - 1)
records = st.binary(max_size=16)


def test_the_declared_headers_have_the_hand_codecs_sizes() -> None:
    batch = sum(element.min_size for element in m.BATCH_LAYOUT.elements)
    tail = sum(element.min_size for element in m.TAIL_LAYOUT.elements)
    # The declarations end with the records block's u32 count.
    assert (batch, tail) == (m.BATCH_HEADER_SIZE + 4, m.TAIL_HEADER_SIZE + 4)


@given(first_sequence=st.integers(0, m.SEQUENCE_LIMIT), count=u32s, rest=records)
def test_the_batch_codec_matches_its_declaration(
    first_sequence: int, count: int, rest: bytes
) -> None:
    count = min(count, m.SEQUENCE_LIMIT - first_sequence)
    declared = m.BATCH_LAYOUT.encode(SimpleNamespace(first_sequence=first_sequence, count=count))
    by_hand = m.encode_batch_header(first_sequence) + count.to_bytes(4, "little")
    assert by_hand == declared
    payload = declared + rest
    got_sequence, got_count, block = m.decode_batch(payload)
    assert m.BATCH_LAYOUT.decode(payload[: len(declared)]) == {
        "first_sequence": got_sequence,
        "count": got_count,
    }
    assert (got_sequence, got_count) == (first_sequence, count)
    assert bytes(block) == payload[m.BATCH_HEADER_SIZE :]


@given(
    first_sequence=u64s,
    position=u64s,
    length=st.integers(1, 2**40),
    producer_id=u64s,
    timestamp_us=i64s,
    count=u32s,
    rest=records,
)
def test_the_tail_records_codec_matches_its_declaration(
    first_sequence: int,
    position: int,
    length: int,
    producer_id: int,
    timestamp_us: int,
    count: int,
    rest: bytes,
) -> None:
    position = min(position, U64_MAX - length)
    header = m.TailHeader(first_sequence, position, position + length, producer_id, timestamp_us)
    fields: dict[str, Any] = {**header._asdict(), "count": count}
    declared = m.TAIL_LAYOUT.encode(SimpleNamespace(**fields))
    by_hand = m.encode_tail_header(header) + count.to_bytes(4, "little")
    assert by_hand == declared
    payload = declared + rest
    got_header, got_count, block = m.decode_tail_records(payload)
    assert m.TAIL_LAYOUT.decode(payload[: len(declared)]) == {
        **got_header._asdict(),
        "count": got_count,
    }
    assert (got_header, got_count) == (header, count)
    assert bytes(block) == payload[m.TAIL_HEADER_SIZE :]


def test_entry_sizes_from_the_declarations_are_the_least_bytes_an_entry_takes() -> None:
    """The room check of a count uses them: a smaller entry than declared would be refused."""
    smallest_info = m.encode_message(m.StreamList(request_id=0, streams=())) + b""
    assert len(smallest_info) == 3
    one = m.StreamInfo(
        stream="a", start_position=0, durable_position=0, tail_position=0, term_length=0
    )
    with_one = m.encode_message(m.StreamList(request_id=0, streams=(one,)))
    streams = next(lay for lay in m.GLOBAL_LAYOUTS if lay.cls is m.StreamList).elements[1]
    assert len(with_one) - len(smallest_info) == streams.kind.entry.min_size  # type: ignore[attr-defined]


# --- LCMUX frames: codec.py's hand codec held to frame_layout.py ----------------

channels = st.one_of(st.integers(0, 20), u64s)
payloads = st.one_of(
    st.binary(max_size=40), st.integers(250, 300).map(bytes), st.just(bytes(70000))
)
frames = st.one_of(
    st.builds(IssueGuarantees, channel=channels, amount=u64s),
    st.builds(Plead, channel=channels, target=u64s),
    st.builds(LimitReceiving, channel=channels, bound=u64s),
    st.builds(AnnounceDropping, channel=channels),
    st.builds(Absolve, channel=channels, amount=u64s),
    st.builds(LimitSending, channel=channels, bound=u64s),
    st.builds(Apologise, channel=channels),
    st.builds(SendGlobal, payload=payloads),
    st.builds(SendChannel, channel=channels, payload=payloads),
)


def _layout_of(frame: Any) -> FrameLayout:
    (layout,) = [layout for layout in FRAME_LAYOUTS if layout.cls is type(frame)]
    return layout


@given(frame=frames)
def test_the_frame_codec_matches_the_declared_frame_layouts(frame: Any) -> None:
    declared = _layout_of(frame).encode(frame)
    assert encode_frame(frame) == declared
    assert frame_layout_of_first_byte(declared[0]) is _layout_of(frame)
    assert _layout_of(frame).decode(declared) == (frame, len(declared))
    assert FrameDecoder(max_payload=1 << 20).feed(declared) == [frame]


@given(first=st.integers(0, 255), rest=st.binary(min_size=40, max_size=40))
def test_the_frame_decoder_reads_any_first_byte_as_its_declared_layout(
    first: int, rest: bytes
) -> None:
    """Every first byte starts exactly one declared frame, and the decoder agrees on it."""
    data = bytes((first,)) + rest
    layout = frame_layout_of_first_byte(first)
    try:
        expected, used = layout.decode(data)
    except ValueError:
        return  # a length beyond the 40 bytes: nothing to compare
    assert FrameDecoder(max_payload=1 << 20).feed(data[:used]) == [expected]


def test_protocol_md_draws_every_frame_as_declared() -> None:
    whole = PROTOCOL_MD.read_text(encoding="utf-8")
    section = whole.split("\n## Frames\n", 1)[1].split("\n## Messages\n", 1)[0]
    drawn: dict[str, tuple[str, list[str]]] = {}
    title = ""
    for line in section.splitlines():
        found = _TITLE.match(line)
        if found:
            title = found.group(1)
        bits = re.match(r"^ \|([01](?: [01])*)\|(.*)\|$", line)
        if bits:
            cells = [cell.strip() for cell in bits.group(2).split("|")]
            drawn[title] = (bits.group(1).replace(" ", ""), cells)
    assert set(drawn) == {layout.cls.__name__ for layout in FRAME_LAYOUTS}
    short = {"channel": "ctag", "length": "ltag"}
    for layout in FRAME_LAYOUTS:
        prefix, cells = drawn[layout.cls.__name__]
        declared = [short[attr] for attr, _ in layout.tags]
        declared += list(layout.tail_order or [attr for attr, _ in layout.tags])
        declared += list(layout.standalone)
        declared += ["payload"] if layout.payload else []
        assert (prefix, cells) == (layout.prefix, declared), layout.cls.__name__
