"""Why a producer could not deliver records."""

from __future__ import annotations

from headgate.protocol.errors import ErrorCode

__all__ = ["BufferFull", "ProducerError", "SessionRefused", "StreamRefused"]


class ProducerError(Exception):
    """Records could not be delivered; the message says to whom and why.

    Raised by every pending and later ``send``, ``send_many`` and ``flush`` once
    the producer gave up (gateway unreachable past ``reconnect_timeout``, the
    session refused, a protocol violation) or was closed.
    """


class SessionRefused(ProducerError):
    """The gateway refused the whole session for good (for example a bad token).

    Trying again cannot help: the producer gave up at once.
    """

    def __init__(self, message: str, code: ErrorCode, text: str) -> None:
        super().__init__(message)
        #: The gateway's reason, as an error code (``UNAUTHENTICATED``, ...).
        self.code = code
        #: The gateway's explanation, for people.
        self.text = text


class StreamRefused(ProducerError):
    """The gateway refused one stream; the producer's other streams go on.

    The refused stream's unacknowledged records are lost; its later sends,
    ``send_many`` calls and ``flush(stream)`` raise this again.
    """

    def __init__(self, stream: str, code: ErrorCode, text: str) -> None:
        detail = f": {text}" if text else ""
        super().__init__(f"the gateway refused stream {stream!r} ({code.name}){detail}")
        #: The refused stream.
        self.stream = stream
        #: The gateway's reason, as an error code.
        self.code = code
        #: The gateway's explanation, for people.
        self.text = text


class BufferFull(Exception):
    """``Producer.send_nowait`` took nothing: the stream's buffer is full.

    A stream holds at most ``max_buffered_bytes`` of records the gateway has
    not acknowledged yet; this is the backpressure of a stream whose
    consumer is behind, not a failure, and nothing was lost. Await
    ``Producer.send`` (which waits for room) or try again later. It is not
    a :class:`ProducerError`, which means records cannot be delivered.
    """

    def __init__(self, stream: str, limit: int) -> None:
        super().__init__(
            f"stream {stream!r} already holds max_buffered_bytes ({limit}) that the gateway "
            "has not acknowledged; await send() to wait for room"
        )
        #: The stream whose buffer is full.
        self.stream = stream
        #: Its bound, ``max_buffered_bytes``.
        self.limit = limit
