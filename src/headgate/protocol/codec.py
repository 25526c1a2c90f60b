"""LCMUX frames to bytes and back, with a decoder that takes bytes as they come.

The first byte of a frame says what the frame is and carries the tags of its
compact U64 header fields (bit 7 is the most significant)::

      7   6   5   4   3   2   1   0
    +---+---+---+---+---+---+---+---+
    | 1 | 1 | 1 | 1 |  channel tag  |  IssueGuarantees   then channel, amount*
    | 1 | 1 | 1 | 0 |  channel tag  |  Plead             then channel, target*
    | 1 | 1 | 0 | 1 |  channel tag  |  LimitReceiving    then channel, bound*
    | 1 | 1 | 0 | 0 |  channel tag  |  AnnounceDropping  then channel
    | 1 | 0 | 1 | 1 |  channel tag  |  Absolve           then channel, amount*
    | 1 | 0 | 1 | 0 |  channel tag  |  LimitSending      then channel, bound*
    | 1 | 0 | 0 | 1 |  channel tag  |  Apologise         then channel
    | 1 | 0 | 0 | 0 |  length tag   |  SendGlobal        then length, payload
    | 0 | length tag|  channel tag  |  SendChannel       then channel, length, payload
    +---+---+---+---+---+---+---+---+

    * a standalone compact U64 (a tag byte of its own)

Every one of the 256 first bytes starts some frame, and every tag is valid, so
the only way a byte stream can be malformed at this layer is a length beyond
what the receiver accepts. ``PROTOCOL.md`` draws each frame in full.
"""

from __future__ import annotations

import struct

from headgate.protocol.c64 import (
    U64_MAX,
    decode_compact,
    decode_standalone,
    encode_compact,
    encode_standalone_into,
)
from headgate.protocol.errors import ErrorCode, FrameError
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    Frame,
    IssueGuarantees,
    LimitReceiving,
    LimitSending,
    Plead,
    SendChannel,
    SendGlobal,
)

__all__ = ["FrameDecoder", "encode_frame", "encode_frame_into"]

# First-byte prefixes (the constant bits, already shifted into place).
_ISSUE_GUARANTEES = 0xF0
_PLEAD = 0xE0
_LIMIT_RECEIVING = 0xD0
_ANNOUNCE_DROPPING = 0xC0
_ABSOLVE = 0xB0
_LIMIT_SENDING = 0xA0
_APOLOGISE = 0x90
_SEND_GLOBAL = 0x80

# Headers of the SendChannel frames that dominate the traffic: channel below 12
# and payload below 256 bytes, so one or two bytes with no arithmetic at encode
# time. Index: length * 12 + channel.
_SMALL_HEADERS: tuple[bytes, ...] = tuple(
    bytes(((length << 4) | channel,)) if length < 4 else bytes((0x40 | channel, length))
    for length in range(256)
    for channel in range(12)
)


# A SendChannel header with the channel inline and a 2-byte length.
_MEDIUM_HEADER = struct.Struct(">BH")


def _flat(view: memoryview) -> memoryview | bytes:
    """Return ``view`` as bytes whose ``len`` is their size and that ``+=`` accepts."""
    if view.c_contiguous:
        return view.cast("B") if view.format != "B" or view.ndim != 1 else view
    return view.tobytes()


def _append_channel_and_value(prefix: int, channel: int, value: int | None, out: bytearray) -> None:
    tag, tail = encode_compact(channel, 4)
    out.append(prefix | tag)
    out += tail
    if value is not None:
        encode_standalone_into(value, out)


def encode_frame_into(frame: Frame, out: bytearray) -> None:
    """Append the encoding of ``frame`` to ``out``.

    This is how a writer batches: encode many frames into one buffer, then hand
    the buffer to the transport in one write. Integers outside 0..2**64-1 raise
    ``ValueError`` and leave ``out`` unchanged.
    """
    if isinstance(frame, SendChannel):
        channel = frame.channel
        payload = frame.payload
        if type(payload) is memoryview:
            payload = _flat(payload)
        length = len(payload)
        if 0 <= channel < 12 and length < 256:
            out += _SMALL_HEADERS[length * 12 + channel]
        elif 0 <= channel < 12 and length < 0x1_0000:
            out += _MEDIUM_HEADER.pack(0x50 | channel, length)
        else:
            channel_tag, channel_tail = encode_compact(channel, 4)
            length_tag, length_tail = encode_compact(length, 3)
            out.append((length_tag << 4) | channel_tag)
            out += channel_tail
            out += length_tail
        out += payload
    elif isinstance(frame, SendGlobal):
        payload = frame.payload
        if type(payload) is memoryview:
            payload = _flat(payload)
        tag, tail = encode_compact(len(payload), 4)
        out.append(_SEND_GLOBAL | tag)
        out += tail
        out += payload
    else:
        # Validate every integer before writing anything, so that a ValueError
        # never leaves half a frame behind in a shared batch buffer.
        staged = bytearray()
        if isinstance(frame, IssueGuarantees):
            _append_channel_and_value(_ISSUE_GUARANTEES, frame.channel, frame.amount, staged)
        elif isinstance(frame, Plead):
            _append_channel_and_value(_PLEAD, frame.channel, frame.target, staged)
        elif isinstance(frame, LimitReceiving):
            _append_channel_and_value(_LIMIT_RECEIVING, frame.channel, frame.bound, staged)
        elif isinstance(frame, AnnounceDropping):
            _append_channel_and_value(_ANNOUNCE_DROPPING, frame.channel, None, staged)
        elif isinstance(frame, Absolve):
            _append_channel_and_value(_ABSOLVE, frame.channel, frame.amount, staged)
        elif isinstance(frame, LimitSending):
            _append_channel_and_value(_LIMIT_SENDING, frame.channel, frame.bound, staged)
        elif isinstance(frame, Apologise):
            _append_channel_and_value(_APOLOGISE, frame.channel, None, staged)
        else:
            raise TypeError(f"not an LCMUX frame: {frame!r}")
        out += staged


def encode_frame(frame: Frame) -> bytes:
    """Return the encoding of one frame (see :func:`encode_frame_into`)."""
    if isinstance(frame, SendChannel):
        channel = frame.channel
        payload = frame.payload
        if 0 <= channel < 12 and type(payload) is bytes and len(payload) < 256:
            return _SMALL_HEADERS[len(payload) * 12 + channel] + payload
    out = bytearray()
    encode_frame_into(frame, out)
    return bytes(out)


# The decoder builds SendChannel frames through their slot descriptors: it is
# what the frozen dataclass __init__ does too, minus the keyword handling and
# the per-field object.__setattr__ lookups, and it halves the cost per frame.
_SET_CHANNEL = SendChannel.__dict__["channel"].__set__
_SET_PAYLOAD = SendChannel.__dict__["payload"].__set__


def _too_large(length: int, max_payload: int) -> FrameError:
    return FrameError(
        f"frame declares a {length}-byte payload; at most {max_payload} accepted",
        code=ErrorCode.FRAME_TOO_LARGE,
    )


class FrameDecoder:
    """Turns a byte stream, in chunks of any size, into LCMUX frames.

    The transport hands every chunk it reads to :meth:`feed` and gets back the
    frames that the chunk completed; a frame split across chunks is kept until
    its last byte arrives. The decoder handles all nine frame kinds: on a
    headgate connection each direction carries the server frames of one session
    and the client frames of the other, and the first byte tells them apart.
    Which frames a peer may send is the session's business, not the decoder's.

    Payloads of ``SendChannel`` and ``SendGlobal`` come out as ``bytes``
    objects of their own, so they stay valid however the caller reuses the
    buffers it fed in.

    Memory is bounded by what has actually arrived. A declared length is
    checked against ``max_payload`` as soon as the header is complete, before
    any payload byte is awaited, so a hostile length costs nothing. After an
    error the decoder is dead: every later :meth:`feed` raises the same error.

    Args:
        max_payload: the largest payload, in bytes, that a ``SendChannel`` or
            ``SendGlobal`` may declare; larger raises ``FrameError`` with code
            ``FRAME_TOO_LARGE``.
    """

    __slots__ = ("_error", "_max_payload", "_need", "_pending")

    def __init__(self, *, max_payload: int) -> None:
        if not 0 <= max_payload <= U64_MAX:
            raise ValueError("max_payload must be in 0..2**64-1")
        self._max_payload = max_payload
        # Bytes of an incomplete frame. Only ever the tail of one frame, so it
        # holds at most one header plus max_payload bytes.
        self._pending = bytearray()
        # How many pending bytes the incomplete frame needs before decoding
        # can make progress; below that, feed only appends. This is what keeps
        # a large payload arriving in tiny chunks linear rather than quadratic.
        self._need = 0
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """How many received bytes are held, waiting for the rest of a frame."""
        return len(self._pending)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Take the next chunk of the byte stream; return the frames it completes.

        Raises ``FrameError`` when the stream is not acceptable (a declared
        payload above ``max_payload``), and again on every later call. The
        frames that the failing chunk completed before the bad header are not
        returned: the error ends the connection, and a producer resends what
        was not acknowledged.
        """
        if self._error is not None:
            raise self._error
        if type(data) is memoryview and not data.c_contiguous:
            data = data.tobytes()
        pending = self._pending
        if pending:
            pending += data
            if len(pending) < self._need:
                return []
            chunk = bytes(pending)
        elif type(data) is bytes:
            chunk = data
        else:
            chunk = bytes(data)
            if not chunk:
                return []
        frames, pos, need = self._scan(chunk, None)
        if pos == len(chunk):
            pending.clear()
        else:
            # Decoding stops only inside the last frame, so this copies less
            # than one frame, and only when the frame can progress (see _need).
            self._pending = bytearray(memoryview(chunk)[pos:])
            self._need = need
        return frames

    def decode_in_place(self, view: memoryview) -> tuple[list[Frame], list[int], int, int]:
        """Decode the complete frames at the start of ``view``, copying nothing.

        This is the receive path of a caller that owns a buffer the bytes were
        read into (the gateway's ring): payloads of ``SendChannel`` and
        ``SendGlobal`` come out as ``memoryview`` slices of ``view``, valid as
        long as the caller keeps those bytes unchanged. An incomplete frame at
        the end is left where it is, for the caller to extend and offer again.

        Returns ``(frames, ends, consumed, need)``: ``ends[i]`` is the offset in
        ``view`` just past ``frames[i]``; ``consumed`` is the offset past the last
        complete frame; ``need`` is how many bytes, counted from ``consumed``,
        the incomplete frame needs before decoding it can make progress (0 when
        ``view`` ends on a frame boundary). The declared length of a frame is
        checked against ``max_payload`` as soon as its header is complete, as
        :meth:`feed` does, and an error is final in the same way.

        Raises:
            FrameError: as :meth:`feed`.
            ValueError: ``view`` is not a contiguous byte view, or :meth:`feed`
                holds the bytes of an incomplete frame (the two ways of
                feeding do not mix inside a frame).
        """
        if self._error is not None:
            raise self._error
        if self._pending:
            raise ValueError("decode_in_place while feed() holds part of a frame")
        if view.format != "B" or view.ndim != 1 or not view.c_contiguous:
            raise ValueError("decode_in_place needs a contiguous one-dimensional byte view")
        ends: list[int] = []
        frames, consumed, need = self._scan(view, ends)
        return frames, ends, consumed, need

    def _scan(
        self, chunk: bytes | memoryview, ends: list[int] | None
    ) -> tuple[list[Frame], int, int]:
        """Decode complete frames from the start of ``chunk``.

        Returns ``(frames, position after the last one, bytes the incomplete
        frame needs from that position)``; with ``ends``, also appends each
        frame's end offset to it.
        """
        # One loop for both ways of feeding: the frame kinds that dominate
        # the traffic are decoded inline, without a call per frame.
        frames: list[Frame] = []
        append = frames.append
        new_frame = object.__new__
        set_channel = _SET_CHANNEL
        set_payload = _SET_PAYLOAD
        max_payload = self._max_payload
        n = len(chunk)
        pos = 0
        need = 0
        while pos < n:
            first = chunk[pos]
            # The fast paths cover every data batch under 64 KiB on the first
            # 254 streams: SendChannel with a 1- or 2-byte length and the
            # channel inline (below 12) or in one byte (tag 12).
            if 0x40 <= first < 0x4C:
                start = pos + 2
                if start > n:
                    need = start - pos
                    break
                channel = first & 0x0F
                length = chunk[pos + 1]
            elif 0x50 <= first < 0x5C:
                start = pos + 3
                if start > n:
                    need = start - pos
                    break
                channel = first & 0x0F
                length = (chunk[pos + 1] << 8) | chunk[pos + 2]
            elif first == 0x4C or first == 0x5C:
                start = pos + (3 if first == 0x4C else 4)
                if start > n:
                    need = start - pos
                    break
                channel = chunk[pos + 1]
                length = chunk[pos + 2] if first == 0x4C else (chunk[pos + 2] << 8) | chunk[pos + 3]
            else:
                frame, progress = self._decode_one(chunk, pos, first)
                if frame is None:
                    need = progress
                    break
                append(frame)
                pos = progress
                if ends is not None:
                    ends.append(pos)
                continue
            if length > max_payload:
                raise self._fail(_too_large(length, max_payload))
            end = start + length
            if end > n:
                need = end - pos
                break
            sent = new_frame(SendChannel)
            set_channel(sent, channel)
            set_payload(sent, chunk[start:end])
            append(sent)
            pos = end
            if ends is not None:
                ends.append(end)
        return frames, pos, need

    def _fail(self, error: FrameError) -> FrameError:
        """Make ``error`` final: the decoder drops its bytes and refuses more."""
        self._error = error
        self._pending = bytearray()
        return error

    def _decode_one(
        self, buf: bytes | memoryview, pos: int, first: int
    ) -> tuple[Frame | None, int]:
        """Decode the frame at ``pos`` the general way.

        Returns ``(frame, position after it)`` or, when ``buf`` ends inside the
        frame, ``(None, bytes the frame needs counted from pos)``.
        """
        n = len(buf)
        more = n - pos + 1  # the header is incomplete: wait for one more byte
        kind = first >> 4
        low = first & 0x0F
        if kind <= 8:
            if kind < 8:
                got = decode_compact(low, 4, buf, pos + 1)
                if got is None:
                    return None, more
                channel, p = got
                got = decode_compact(kind, 3, buf, p)
            else:
                channel = -1
                got = decode_compact(low, 4, buf, pos + 1)
            if got is None:
                return None, more
            length, start = got
            if length > self._max_payload:
                raise self._fail(_too_large(length, self._max_payload))
            end = start + length
            if end > n:
                return None, end - pos
            payload = buf[start:end]
            if channel < 0:
                return SendGlobal(payload=payload), end
            return SendChannel(channel=channel, payload=payload), end
        got = decode_compact(low, 4, buf, pos + 1)
        if got is None:
            return None, more
        channel, p = got
        if kind == 0xC:
            return AnnounceDropping(channel=channel), p
        if kind == 0x9:
            return Apologise(channel=channel), p
        got = decode_standalone(buf, p)
        if got is None:
            return None, more
        value, p = got
        if kind == 0xF:
            return IssueGuarantees(channel=channel, amount=value), p
        if kind == 0xE:
            return Plead(channel=channel, target=value), p
        if kind == 0xD:
            return LimitReceiving(channel=channel, bound=value), p
        if kind == 0xB:
            return Absolve(channel=channel, amount=value), p
        return LimitSending(channel=channel, bound=value), p
