"""Message layouts, declared once: the encoder, the decoder and the documentation check read them.

A :class:`Layout` lists a message's fields in wire order, each with its wire
type (a :class:`Kind`): ``c64``, ``u8`` enums and flags, ``text(N)``,
``bytes(N)``, ``name``, fixed little-endian integers, a choice selected by a
``u8``, a field present by a byte or a flag bit, and counted repeated entries.
:meth:`Layout.encode` and :meth:`Layout.decode` walk that list, so a
message's encoder and decoder cannot drift apart, and :meth:`Layout.rows`
gives the ``(field, notation)`` rows that ``PROTOCOL.md``'s diagrams must show
(the test that reads them lives in ``tests/protocol``).

The rules that are not about one field (a count that the bytes cannot hold, a
holder index past the gateways, an empty address) are parameters of the kind
that carries them, with the text the peer gets, so that every refusal keeps its
:class:`MessageError` (decoding) or ``ValueError`` (encoding) and its words.

Encoding a value that the peer would reject raises ``ValueError``; decoding
anything malformed raises :class:`MessageError`. Nothing here knows a message
type: ``messages.py`` declares them.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any, ClassVar

from headgate.protocol.c64 import U64_MAX, Buffer, decode_standalone, encode_standalone_into
from headgate.protocol.errors import MessageError

__all__ = [
    "C64",
    "I64LE",
    "NAME_LIMIT",
    "NAME_PATTERN",
    "U32LE",
    "U64LE",
    "BitFlags",
    "Bool8",
    "Bytes",
    "Choice",
    "Counted",
    "Element",
    "Enum8",
    "Field",
    "FlagSet",
    "Kind",
    "Layout",
    "Name",
    "Present",
    "Repeated",
    "Row",
    "Struct",
    "Text",
    "Variant",
    "WireReader",
    "check_u64",
]

#: A doc row: ``(field name, notation)``, or ``("*", entry rows)`` for the
#: entries of a :class:`Repeated` (``None`` rows where the entry is a struct
#: drawn in a diagram of its own).
Row = tuple[str, Any]

#: Stream, schema and consumer names: ASCII, so their UTF-8 length is their length.
NAME_PATTERN = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
#: Longest name, in bytes.
NAME_LIMIT = 255

_U64LE = struct.Struct("<Q")
_U32LE = struct.Struct("<I")
_I64LE = struct.Struct("<q")


def check_u64(value: int, what: str) -> None:
    """Refuse (``ValueError``) an integer that no u64 field can carry."""
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{what} {value} is not an unsigned 64-bit integer")


class WireReader:
    """A cursor over one message's bytes; every shortfall is a MessageError.

    ``top`` is the message's fields decoded so far, for the rules that look
    across entries (a partition's holder must name one of the gateways).
    """

    __slots__ = ("buf", "pos", "top", "what")

    def __init__(self, payload: Buffer, what: str) -> None:
        self.buf = bytes(payload)
        self.pos = 0
        self.what = what
        self.top: dict[str, Any] = {}

    def fail(self, problem: str) -> MessageError:
        return MessageError(f"{self.what}: {problem}")

    def u8(self, label: str) -> int:
        if self.pos >= len(self.buf):
            raise self.fail(f"truncated before {label}")
        value = self.buf[self.pos]
        self.pos += 1
        return value

    def c64(self, label: str) -> int:
        got = decode_standalone(self.buf, self.pos)
        if got is None:
            raise self.fail(f"truncated in {label}")
        value, self.pos = got
        return value

    def fixed(self, codec: struct.Struct, label: str) -> int:
        end = self.pos + codec.size
        if end > len(self.buf):
            raise self.fail(f"truncated in {label}")
        (value,) = codec.unpack_from(self.buf, self.pos)
        self.pos = end
        return int(value)

    def raw(self, limit: int, label: str) -> bytes:
        length = self.c64(f"the length of {label}")
        if length > limit:
            raise self.fail(f"{label} is {length} bytes; at most {limit} allowed")
        end = self.pos + length
        if end > len(self.buf):
            raise self.fail(f"truncated in {label}")
        data = self.buf[self.pos : end]
        self.pos = end
        return data

    def finish(self) -> None:
        if self.pos != len(self.buf):
            raise self.fail(f"{len(self.buf) - self.pos} trailing bytes")


# --- kinds: how one value is carried -----------------------------------------


class Kind:
    """How one value is carried: its notation in PROTOCOL.md, its least size, its codec.

    ``put`` appends ``value`` (``top`` is the whole message, for rules across
    entries); ``take`` reads it back (``into`` holds the enclosing entry's
    fields read so far, for error texts that name them).
    """

    notation: ClassVar[str] = ""
    min_size: int = 1

    def put(self, out: bytearray, value: Any, top: Any) -> None:
        raise NotImplementedError

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def rows(self, name: str) -> list[Row]:
        return [(name, self.notation)]

    @property
    def prechecks(self) -> bool:
        """Whether :meth:`precheck` refuses anything (a layout calls only those that do)."""
        return False

    def precheck(self, value: Any) -> None:
        """Refuse a value of a message's own field before anything is written."""


@dataclass(frozen=True, slots=True)
class C64(Kind):
    """A standalone compact U64, optionally bounded.

    ``bounds_text`` (encoding) and ``bounds_problem`` (decoding, after the
    message type) are what a value outside ``minimum..maximum`` gets; they may
    name ``{value}`` and the enclosing entry's fields.
    """

    notation: ClassVar[str] = "c64"
    label: str
    minimum: int = 0
    maximum: int = U64_MAX
    bounds_text: str = ""
    bounds_problem: str = ""
    min_size: int = 1

    @property
    def prechecks(self) -> bool:
        return bool(self.bounds_text)

    def precheck(self, value: Any) -> None:
        self._check_bounds(value)

    def _check_bounds(self, value: int) -> None:
        # Only the declared bounds: a value past a u64 gets check_u64's words.
        if self.bounds_text and (
            value < self.minimum or (self.maximum < value and self.maximum != U64_MAX)
        ):
            raise ValueError(self.bounds_text.format(value=value))

    def put(self, out: bytearray, value: int, top: Any) -> None:
        if self.bounds_text:
            self._check_bounds(value)
        if not 0 <= value <= U64_MAX:
            check_u64(value, self.label)
        encode_standalone_into(value, out)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> int:
        value = reader.c64(self.label)
        if self.bounds_problem and not self.minimum <= value <= self.maximum:
            raise reader.fail(self.bounds_problem.format(value=value, **into))
        return value


@dataclass(frozen=True, slots=True)
class Counted(Kind):
    """A count that may be unknown, as one c64: the count plus one, 0 for None."""

    notation: ClassVar[str] = "c64"
    label: str

    def put(self, out: bytearray, value: int | None, top: Any) -> None:
        wire = 0 if value is None else value + 1
        check_u64(wire, self.label)
        encode_standalone_into(wire, out)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> int | None:
        wire = reader.c64(self.label)
        return None if wire == 0 else wire - 1


@dataclass(frozen=True, slots=True)
class _FixedInt(Kind):
    label: str
    codec: ClassVar[struct.Struct]
    low: ClassVar[int] = 0
    high: ClassVar[int] = U64_MAX
    range_words: ClassVar[str] = "an unsigned 64-bit integer"

    def put(self, out: bytearray, value: int, top: Any) -> None:
        if not self.low <= value <= self.high:
            raise ValueError(f"{self.label} {value} is not {self.range_words}")
        out += self.codec.pack(value)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> int:
        return reader.fixed(self.codec, self.label)


class U64LE(_FixedInt):
    """A u64, 8 bytes little-endian."""

    notation: ClassVar[str] = "u64le"
    codec: ClassVar[struct.Struct] = _U64LE
    min_size: int = 8


class U32LE(_FixedInt):
    """A u32, 4 bytes little-endian."""

    notation: ClassVar[str] = "u32le"
    codec: ClassVar[struct.Struct] = _U32LE
    high: ClassVar[int] = (1 << 32) - 1
    range_words: ClassVar[str] = "an unsigned 32-bit integer"
    min_size: int = 4


class I64LE(_FixedInt):
    """A signed 64-bit integer, 8 bytes little-endian."""

    notation: ClassVar[str] = "i64le"
    codec: ClassVar[struct.Struct] = _I64LE
    low: ClassVar[int] = -(1 << 63)
    high: ClassVar[int] = (1 << 63) - 1
    range_words: ClassVar[str] = "a signed 64-bit integer"
    min_size: int = 8


@dataclass(frozen=True, slots=True)
class Bytes(Kind):
    """``bytes(N)``: a c64 length at most ``limit``, then the raw bytes."""

    limit: int
    label: str

    @property
    def notation(self) -> str:  # type: ignore[override]
        return f"bytes({self.limit})"

    def put(self, out: bytearray, value: bytes, top: Any) -> None:
        _put_bytes(out, bytes(value), self.limit, self.label)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> bytes:
        return reader.raw(self.limit, self.label)


def _put_bytes(out: bytearray, data: bytes, limit: int, label: str) -> None:
    if len(data) > limit:
        raise ValueError(f"{label} is {len(data)} bytes; at most {limit} allowed")
    encode_standalone_into(len(data), out)
    out += data


@dataclass(frozen=True, slots=True)
class Text(Kind):
    """``text(N)``: a c64 byte length at most ``limit``, then UTF-8.

    ``put_label`` is the encoder's word for it where it differs from the
    decoder's. With ``empty_text`` and ``empty_problem`` the text may not be
    empty (and then takes at least 2 bytes).
    """

    limit: int
    label: str
    put_label: str = ""
    empty_text: str = ""
    empty_problem: str = ""

    @property
    def notation(self) -> str:  # type: ignore[override]
        return f"text({self.limit})"

    @property
    def min_size(self) -> int:  # type: ignore[override]
        return 2 if self.empty_problem else 1

    def put(self, out: bytearray, value: str, top: Any) -> None:
        if self.empty_text and not value:
            raise ValueError(self.empty_text)
        _put_bytes(out, value.encode("utf-8"), self.limit, self.put_label or self.label)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> str:
        data = reader.raw(self.limit, self.label)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise reader.fail(f"{self.label} is not UTF-8") from error
        if self.empty_problem and not text:
            raise reader.fail(self.empty_problem.format(**into))
        return text


@dataclass(frozen=True, slots=True)
class Name(Kind):
    """``name``: ``text(255)`` matching ``[A-Za-z0-9][A-Za-z0-9._-]{0,254}``."""

    notation: ClassVar[str] = "name"
    label: str
    min_size: int = 2

    def put(self, out: bytearray, value: str, top: Any) -> None:
        if not (value.isascii() and NAME_PATTERN.fullmatch(value.encode("ascii"))):
            raise ValueError(f"{self.label} {value!r} is not a valid name")
        _put_bytes(out, value.encode("ascii"), NAME_LIMIT, self.label)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> str:
        data = reader.raw(NAME_LIMIT, self.label)
        if NAME_PATTERN.fullmatch(data) is None:
            raise reader.fail(f"{self.label} {data!r} is not a valid name")
        return data.decode("ascii")


@dataclass(frozen=True, slots=True)
class Enum8(Kind):
    """A ``u8`` naming a member of ``enum``; ``forbidden`` is a member that may not be sent."""

    notation: ClassVar[str] = "u8"
    enum: type[IntEnum]
    label: str
    forbidden: IntEnum | None = None
    forbidden_text: str = ""
    forbidden_problem: str = ""

    def put(self, out: bytearray, value: IntEnum, top: Any) -> None:
        if self.forbidden is not None and value == self.forbidden:
            raise ValueError(self.forbidden_text)
        out.append(self.enum(value))

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> IntEnum:
        raw = reader.u8(self.label)
        try:
            value = self.enum(raw)
        except ValueError:
            raise reader.fail(f"unknown {self.label} {raw}") from None
        if self.forbidden is not None and value == self.forbidden:
            raise reader.fail(self.forbidden_problem)
        return value


@dataclass(frozen=True, slots=True)
class Bool8(Kind):
    """A ``u8`` that is 0 (False) or 1 (True)."""

    notation: ClassVar[str] = "u8"
    label: str

    def put(self, out: bytearray, value: bool, top: Any) -> None:
        out.append(1 if value else 0)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> bool:
        raw = reader.u8(self.label)
        if raw > 1:
            raise reader.fail(f"{self.label} must be 0 or 1, not {raw}")
        return raw == 1


@dataclass(frozen=True, slots=True)
class FlagSet(Kind):
    """A ``u8`` of ``IntFlag`` bits, all outside ``known`` reserved (must be 0)."""

    notation: ClassVar[str] = "u8"
    flags: type[IntFlag]
    known: int
    label: str
    undefined_text: str

    @property
    def prechecks(self) -> bool:
        return True

    def precheck(self, value: Any) -> None:
        self.put(bytearray(), value, None)

    def put(self, out: bytearray, value: IntFlag, top: Any) -> None:
        bits = int(value)
        if bits & ~self.known:
            raise ValueError(self.undefined_text.format(bits=bits))
        out.append(bits)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> IntFlag:
        bits = reader.u8(self.label)
        if bits & ~self.known:
            raise reader.fail(f"undefined {self.label} {bits:#04x}")
        return self.flags(bits)


@dataclass(frozen=True, slots=True)
class Present(Kind):
    """A value that may be absent (None): a presence byte (0 or 1), then the value if 1.

    Its refusal of another presence byte names no message type (as it always has).
    """

    inner: Kind
    label: str
    wire_presence: str

    def put(self, out: bytearray, value: Any, top: Any) -> None:
        if value is None:
            out.append(0)
        else:
            out.append(1)
            self.inner.put(out, value, top)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> Any:
        known = reader.u8(f"{self.label} presence")
        if known > 1:
            raise MessageError(f"{self.label} presence must be 0 or 1, not {known}")
        return self.inner.take(reader, into) if known else None

    def rows(self, name: str) -> list[Row]:
        return [(self.wire_presence, "u8"), *self.inner.rows(name)]


@dataclass(frozen=True, slots=True)
class Variant:
    """One value of a :class:`Choice`: a constant, or a payload that follows the selector."""

    #: The selector byte.
    tag: int
    #: The value itself, for a variant that carries nothing.
    constant: object = None
    #: How the payload is carried, for a variant that carries one.
    payload: Kind | None = None
    #: Which values this variant encodes (payload variants only).
    accepts: type | tuple[type, ...] = ()
    #: The payload's name in PROTOCOL.md.
    wire: str = ""


@dataclass(frozen=True, slots=True)
class Choice(Kind):
    """A ``u8`` selector, then the selected variant's payload (if any)."""

    label: str
    variants: tuple[Variant, ...]
    unknown_problem: str

    def put(self, out: bytearray, value: Any, top: Any) -> None:
        for variant in self.variants:
            if variant.payload is None:
                if value is variant.constant:
                    out.append(variant.tag)
                    return
            elif isinstance(value, variant.accepts):
                out.append(variant.tag)
                variant.payload.put(out, value, top)
                return
        raise ValueError(f"{self.label} {value!r} has no encoding")

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> Any:
        tag = reader.u8(self.label)
        for variant in self.variants:
            if variant.tag == tag:
                if variant.payload is None:
                    return variant.constant
                return variant.payload.take(reader, into)
        raise reader.fail(self.unknown_problem.format(tag=tag))

    def rows(self, name: str) -> list[Row]:
        rows: list[Row] = [(name, "u8")]
        for variant in self.variants:
            if variant.payload is None:
                continue
            payload_rows = variant.payload.rows(variant.wire)
            if len(payload_rows) == 1:
                payload_rows = [(variant.wire, payload_rows[0][1])]
            rows += [row for row in payload_rows if row not in rows]
        return rows


# --- elements: how a message's fields map to kinds ----------------------------


class Element:
    """One or more fields of a message or entry, in wire order."""

    def put(self, out: bytearray, source: Any, top: Any) -> None:
        raise NotImplementedError

    def take(self, reader: WireReader, into: dict[str, Any]) -> None:
        raise NotImplementedError

    def rows(self) -> list[Row]:
        raise NotImplementedError

    @property
    def min_size(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Field(Element):
    """One attribute carried as one kind; ``wire`` is its name in PROTOCOL.md if not ``attr``."""

    attr: str
    kind: Kind
    wire: str = ""

    def put(self, out: bytearray, source: Any, top: Any) -> None:
        self.kind.put(out, getattr(source, self.attr), top)

    def take(self, reader: WireReader, into: dict[str, Any]) -> None:
        into[self.attr] = self.kind.take(reader, into)

    def rows(self) -> list[Row]:
        return self.kind.rows(self.wire or self.attr)

    @property
    def min_size(self) -> int:
        return self.kind.min_size


@dataclass(frozen=True, slots=True)
class BitFlags(Element):
    """A ``u8`` of boolean attributes, one bit each, and fields present by a bit.

    ``present`` fields follow the byte, in order, each when its bit is set
    (None when not). Every other bit is reserved and must be 0.
    """

    label: str
    bits: tuple[tuple[str, int], ...]
    present: tuple[tuple[int, Field], ...] = ()
    wire: str = "flags"
    _known: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        known = 0
        for _, bit in self.bits:
            known |= bit
        for bit, _ in self.present:
            known |= bit
        object.__setattr__(self, "_known", known)

    def put(self, out: bytearray, source: Any, top: Any) -> None:
        value = 0
        for attr, bit in self.bits:
            if getattr(source, attr):
                value |= bit
        present = [(bit, f) for bit, f in self.present if getattr(source, f.attr) is not None]
        for bit, _ in present:
            value |= bit
        out.append(value)
        for _, present_field in present:
            present_field.put(out, source, top)

    def take(self, reader: WireReader, into: dict[str, Any]) -> None:
        value = reader.u8(self.label)
        if value & ~self._known:
            raise reader.fail(f"undefined {self.label} {value:#04x}")
        for attr, bit in self.bits:
            into[attr] = bool(value & bit)
        for bit, present_field in self.present:
            if value & bit:
                present_field.take(reader, into)
            else:
                into[present_field.attr] = None

    def rows(self) -> list[Row]:
        rows: list[Row] = [(self.wire, "u8")]
        for _, present_field in self.present:
            rows += present_field.rows()
        return rows

    @property
    def min_size(self) -> int:
        return 1


@dataclass(frozen=True, slots=True)
class Struct(Kind):
    """A group of fields made into one value of ``cls`` (an entry, a scope)."""

    cls: type
    elements: tuple[Element, ...]

    @property
    def min_size(self) -> int:  # type: ignore[override]
        return sum(element.min_size for element in self.elements)

    def put(self, out: bytearray, value: Any, top: Any) -> None:
        for element in self.elements:
            element.put(out, value, top)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> Any:
        entry: dict[str, Any] = {}
        for element in self.elements:
            element.take(reader, entry)
        return self.cls(**entry)

    def rows(self, name: str) -> list[Row]:
        return [row for element in self.elements for row in element.rows()]


@dataclass(frozen=True, slots=True)
class Repeated(Kind):
    """A c64 count, then that many entries, made into a tuple.

    The count must lie in ``minimum..maximum`` and, with ``fits``, must be one
    the message could hold: count x the entry's least size (from its
    declaration) within the whole message. Anything else gets ``count_text``
    (encoding) or ``count_problem`` (decoding), which may name ``{count}``
    and the enclosing entry's fields.

    With ``indexes``, each entry is an index into that top-level tuple field
    of the message (a partition's holder among the gateways), checked once
    all entries are read: an index past it gets ``index_text`` or
    ``index_problem`` (naming ``{value}`` and the enclosing entry's fields).
    """

    entry: Kind
    count_label: str
    count_problem: str
    count_text: str = ""
    minimum: int = 0
    maximum: int = U64_MAX
    fits: bool = False
    wire_count: str = "count"
    indexes: str = ""
    index_text: str = ""
    index_problem: str = ""

    @property
    def min_size(self) -> int:  # type: ignore[override]
        return 1 + self.minimum * self.entry.min_size

    @property
    def prechecks(self) -> bool:
        return bool(self.count_text)

    def precheck(self, value: Any) -> None:
        self._check_count(len(value))

    def _check_count(self, count: int) -> None:
        if self.count_text and not self.minimum <= count <= self.maximum:
            raise ValueError(self.count_text.format(count=count))

    def put(self, out: bytearray, value: Sequence[Any], top: Any) -> None:
        count = len(value)
        self._check_count(count)
        encode_standalone_into(count, out)
        indexed = len(getattr(top, self.indexes)) if self.indexes else 0
        for entry in value:
            if self.indexes and not 0 <= entry < indexed:
                raise ValueError(self.index_text.format(value=entry))
            self.entry.put(out, entry, top)

    def take(self, reader: WireReader, into: Mapping[str, Any]) -> tuple[Any, ...]:
        count = reader.c64(self.count_label)
        if not self.minimum <= count <= self.maximum or (
            self.fits and count > len(reader.buf) // self.entry.min_size
        ):
            raise reader.fail(self.count_problem.format(count=count, **into))
        entry = self.entry
        entries = tuple([entry.take(reader, into) for _ in range(count)])
        if self.indexes:
            indexed = len(reader.top[self.indexes])
            for index in entries:
                if index >= indexed:
                    raise reader.fail(self.index_problem.format(value=index, **into))
        return entries

    def rows(self, name: str) -> list[Row]:
        return [(self.wire_count, "c64"), ("*", self.entry.rows(name))]


# --- layouts: whole messages --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Layout:
    """One message's bytes: its type byte (None for a channel message), then its fields.

    A class may have several layouts (a Release of the default consumer is
    type 0x12, one naming a consumer 0x13): ``when`` says which one a value
    takes, and ``fixed`` gives the attributes a layout does not carry, as the
    decoder sets them. ``refusal`` is the ``ValueError`` text for a value whose
    ``fixed`` attribute is not what this layout implies.
    """

    cls: type
    what: str
    type_byte: int | None
    elements: tuple[Element, ...]
    when: Callable[[Any], bool] | None = None
    fixed: Mapping[str, object] = field(default_factory=dict)
    refusal: str = ""
    #: The message's own fields whose limits are checked before anything is
    #: written (a count over its maximum, reserved flags, a bound), so that
    #: such a refusal comes first, as it always has.
    _prechecked: tuple[Field, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        prechecked = tuple(
            element
            for element in self.elements
            if isinstance(element, Field) and element.kind.prechecks
        )
        object.__setattr__(self, "_prechecked", prechecked)

    def encode(self, message: Any) -> bytes:
        for attr, value in self.fixed.items():
            if getattr(message, attr) != value:
                raise ValueError(self.refusal)
        for prechecked in self._prechecked:
            prechecked.kind.precheck(getattr(message, prechecked.attr))
        out = bytearray()
        if self.type_byte is not None:
            out.append(self.type_byte)
        for element in self.elements:
            element.put(out, message, message)
        return bytes(out)

    def decode(self, payload: Buffer) -> Any:
        reader = WireReader(payload, self.what)
        if self.type_byte is not None:
            reader.pos = 1
        into = reader.top
        for element in self.elements:
            element.take(reader, into)
        reader.finish()
        into.update(self.fixed)
        return self.cls(**into)

    def rows(self) -> list[Row]:
        """The ``(field, notation)`` rows PROTOCOL.md draws, the type byte first."""
        head: list[Row] = [] if self.type_byte is None else [(f"{self.type_byte:02x}", "u8")]
        return head + [row for element in self.elements for row in element.rows()]
