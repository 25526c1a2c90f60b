"""Errors a peer can cause, each carrying the code that is sent back to it.

Every violation that a remote peer can commit maps to exactly one
:class:`ErrorCode`. The gateway answers such a violation with an ``Error``
message carrying that code and then closes the connection (or, for a
per-stream refusal, only refuses that stream). Local misuse of the API
(calling a method in the wrong state) raises ordinary ``ValueError`` or
``RuntimeError`` instead, because no peer is at fault.

The tree is deliberately small::

    ProtocolError
    ├── FrameError          bytes that are not a valid frame
    ├── MessageError        a valid frame whose payload is not a valid message
    ├── FlowControlError    guarantees, absolution, apologies, limits
    └── HandleError         data handles: unknown, freed, double free
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Codes carried by ``Error`` messages on the wire (one byte)."""

    #: Not an error; reserved so that a zeroed field is never mistaken for one.
    NONE = 0
    #: The byte stream is not a sequence of valid LCMUX frames.
    MALFORMED_FRAME = 1
    #: A frame declares a payload larger than the receiver accepts.
    FRAME_TOO_LARGE = 2
    #: A valid frame that this peer may not send in its role or state.
    UNEXPECTED_FRAME = 3
    #: A SendGlobal or channel message whose content does not decode.
    MALFORMED_MESSAGE = 4
    #: The peer absolved more guarantees than it holds.
    ABSOLVED_TOO_MUCH = 5
    #: The peer apologised on a channel where nothing was dropped.
    UNEXPECTED_APOLOGY = 6
    #: The peer sent more bytes than its own LimitSending bound allows.
    LIMIT_EXCEEDED = 7
    #: A LimitSending that does not strictly tighten an earlier bound (LCMUX).
    #: (A LimitReceiving is not checked: the client only estimates the bound.)
    LIMIT_LOOSENED = 8
    #: A message refers to a data handle that was never bound.
    UNKNOWN_HANDLE = 9
    #: A message refers to a data handle the peer promised not to use again.
    HANDLE_FREED = 10
    #: The session's opening message is missing, late or of another version.
    BAD_HELLO = 11
    #: Authentication failed.
    UNAUTHENTICATED = 12
    #: Authenticated, but without the right for this stream or operation.
    FORBIDDEN = 13
    #: A resource bound (connections, handles, buffered bytes) was reached.
    RESOURCE_EXHAUSTED = 14
    #: The gateway cannot store data (for example, its disk is full).
    STORAGE_UNAVAILABLE = 15
    #: The connection was idle or too slow for too long.
    TIMEOUT = 16
    #: The gateway is shutting down.
    SHUTTING_DOWN = 17
    #: A failure inside the gateway that is not the peer's fault.
    INTERNAL = 18
    #: Scoped to a stream, a notice, not a refusal: the gateway cannot store
    #: the stream now (its disk is full). It issues no guarantees on the
    #: stream, acknowledges nothing more, keeps the batches it has, and stores
    #: them (once) when space returns; new guarantees then say it is back.
    STORAGE_FULL = 19
    #: The Hello's producer id belongs to another peer (another token, or the
    #: holder of its secret): nothing is stored under it for this peer.
    PRODUCER_FENCED = 20
    #: A batch's first sequence skips ahead of the producer's next sequence on
    #: the stream (sequences are contiguous); the batch is not stored.
    OUT_OF_SEQUENCE = 21
    #: A consumer read (Fetch) from a position the log no longer holds: it was
    #: freed before that consumer read it (a non-blocking consumer with
    #: ``on_data_loss = "fail"``). The text names both positions.
    DATA_LOST = 22
    #: A Release or Fetch names a consumer the stream does not have.
    UNKNOWN_CONSUMER = 23
    #: Scoped to a stream: the gateway is still recovering the stream's log
    #: after a restart. Not a refusal for good: nothing was stored or lost,
    #: and the same bind succeeds once recovery is done; try again soon.
    RECOVERING = 24
    # --- a fleet of gateways (a cluster file; codes 35 to 39) ---
    #: Scoped to a stream: the stream is a partition of a partitioned stream
    #: that another gateway of the cluster holds (the text names it and its
    #: address); or, connection-wide, a read of such a partition.
    WRONG_GATEWAY = 35
    #: Scoped to a stream: the name is a partitioned stream's own (or a
    #: partition number it does not have); only its partitions are logs.
    PARTITIONED_STREAM = 36


class ProtocolError(Exception):
    """A violation by the remote peer; ``code`` is what the peer is told."""

    code: ErrorCode = ErrorCode.UNEXPECTED_FRAME

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {super().__str__()}"


class FrameError(ProtocolError):
    """The bytes received are not a valid frame."""

    code = ErrorCode.MALFORMED_FRAME


class MessageError(ProtocolError):
    """A frame's content is not a valid headgate message."""

    code = ErrorCode.MALFORMED_MESSAGE


class FlowControlError(ProtocolError):
    """A violation of the guarantee, absolution, apology or limit rules."""

    code = ErrorCode.UNEXPECTED_FRAME


class HandleError(ProtocolError):
    """A violation of the data-handle rules."""

    code = ErrorCode.UNKNOWN_HANDLE
