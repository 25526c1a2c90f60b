"""The nine LCMUX frames, as values.

This module holds only what a frame *is*. How a frame becomes bytes and back
lives in :mod:`headgate.protocol.codec`, and the byte layout is drawn there and
in ``PROTOCOL.md``.

Four frames travel from the receiving side of a channel (the LCMUX *server*)
to the sending side (the LCMUX *client*); five travel the other way. The first
byte of a frame tells which, so both roles can share one byte stream, which is
how headgate runs a session in each direction over a single connection.
"""

from __future__ import annotations

from dataclasses import dataclass

Payload = bytes | bytearray | memoryview


# --- server to client ------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class IssueGuarantees:
    """A binding promise of more buffer capacity on a channel."""

    #: The logical channel the promise is for.
    channel: int
    #: How many more bytes of channel messages will certainly be buffered.
    amount: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Plead:
    """A request to absolve guarantees until the client holds ``target``."""

    #: The logical channel whose buffer the server wants to shrink.
    channel: int
    #: How many guarantees the server would like the client to keep.
    target: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitReceiving:
    """A promise to accept at most ``bound`` more bytes on a channel."""

    #: The logical channel being limited (closed when the bound reaches zero).
    channel: int
    #: How many more bytes of channel messages the server will accept.
    bound: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AnnounceDropping:
    """The server has started dropping messages on a channel until an apology."""

    #: The logical channel on which messages are being dropped.
    channel: int


# --- client to server ------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SendChannel:
    """One channel message; in headgate one frame carries exactly one message."""

    #: The logical channel the message belongs to.
    channel: int
    #: The message bytes.
    payload: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class Absolve:
    """The client gives up ``amount`` of its guarantees on a channel."""

    #: The logical channel whose guarantees are given up.
    channel: int
    #: How many bytes of guarantees the server is absolved of.
    amount: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitSending:
    """A promise to send at most ``bound`` more bytes on a channel."""

    #: The logical channel being limited (closed when the bound reaches zero).
    channel: int
    #: How many more bytes of channel messages the client may still send.
    bound: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Apologise:
    """The client has seen AnnounceDropping; the server may accept again."""

    #: The logical channel on which the server may stop dropping.
    channel: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SendGlobal:
    """A control message that is never buffered and needs no guarantees."""

    #: The message bytes (exactly one headgate global message).
    payload: Payload


ServerFrame = IssueGuarantees | Plead | LimitReceiving | AnnounceDropping
ClientFrame = SendChannel | Absolve | LimitSending | Apologise | SendGlobal
Frame = ServerFrame | ClientFrame

SERVER_FRAMES: tuple[type, ...] = (IssueGuarantees, Plead, LimitReceiving, AnnounceDropping)
CLIENT_FRAMES: tuple[type, ...] = (SendChannel, Absolve, LimitSending, Apologise, SendGlobal)
