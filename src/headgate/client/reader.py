"""The reader library: read a stream's log through a gateway, or watch it live.

A :class:`Reader` is one connection to a gateway. It can

* list the gateway's streams and their positions (:meth:`Reader.list_streams`),
* fetch a stretch of a stream's log, batch by batch, reliably
  (:meth:`Reader.fetch`, or :meth:`Reader.fetch_all` for a list),
* subscribe to a stream's new batches, lossily (:meth:`Reader.subscribe`),
* and report a consumer's progress with Release (:meth:`Reader.release`).

Flow control is the protocol's: the reader is the receiving side of the
channels its data arrives on, and it issues guarantees for a buffer of
``buffer_bytes`` per channel. It issues them again only as the application
takes batches, so a slow application makes the gateway pause a fetch (or skip
batches of a live tail and say how many with Missed), never buffer without
bound on either side.

:class:`SyncReader` offers the same calls without an event loop, for a Spark
executor's ``read()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from headgate.client.address import GatewayAddress
from headgate.client.link import GatewayLink
from headgate.client.security import ClientSecurity, SecurityError, describe_tls_failure
from headgate.config import ConfigError
from headgate.costs import batch_cost
from headgate.log import LogFrame
from headgate.protocol import messages as m
from headgate.protocol.c64 import U64_MAX
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.session import (
    Event,
    MessageReceived,
    Role,
    Session,
    StreamBound,
    TailReceived,
    WelcomeReceived,
)

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "MissedBatches",
    "Reader",
    "ReaderError",
    "ReaderRefused",
    "Subscription",
    "SyncReader",
    "TailBatch",
]

#: Bytes of TailRecords the reader buffers per channel (its guarantees).
DEFAULT_BUFFER_BYTES = 4 * 1024 * 1024
#: Bytes of bind messages the gateway may send (one stream name each).
BIND_BUFFER_BYTES = 64 * 1024
#: The largest message the reader accepts from the gateway.
MAX_MESSAGE_SIZE = 64 * 1024 * 1024

T = TypeVar("T")


class ReaderError(Exception):
    """The gateway could not be read; the message names its address and the reason."""


class ReaderRefused(ReaderError):
    """The gateway refused this reader: a bad token (``UNAUTHENTICATED``), a stream
    the token may not read or a Release without ``admin`` (``FORBIDDEN``), ...

    The gateway closes the connection with such an error.
    """

    def __init__(self, message: str, code: ErrorCode, text: str) -> None:
        super().__init__(message)
        #: The gateway's reason, as an error code.
        self.code = code
        #: The gateway's explanation, for people.
        self.text = text


@dataclass(frozen=True, slots=True)
class TailBatch:
    """One stored batch: a log frame's header and its records block."""

    #: The stream.
    stream: str
    #: The frame's header: sequence, positions, producer, timestamp.
    header: m.TailHeader
    #: How many records the batch holds.
    record_count: int
    #: The records block (``headgate.protocol.records`` decodes it), a copy.
    records: bytes

    @property
    def position(self) -> int:
        return self.header.position

    @property
    def end_position(self) -> int:
        return self.header.end_position

    def to_frame(self) -> LogFrame:
        """The batch as the log reader would return it (for the Spark decoder)."""
        h = self.header
        return LogFrame(
            h.position,
            h.end_position,
            h.producer_id,
            h.first_sequence,
            self.record_count,
            h.timestamp_us,
            memoryview(self.records),
        )


@dataclass(frozen=True, slots=True)
class MissedBatches:
    """The gateway skipped batches of a live tail because this reader was slow."""

    #: How many batches were skipped.
    count: int


class _Channel:
    """What arrived on one of the gateway's stream handles and is not taken yet."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.handle: int | None = None
        self.items: deque[tuple[TailBatch | MissedBatches, int]] = deque()  # (item, size)
        self.wake = asyncio.Event()


class _Fetch:
    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self.done: m.FetchDone | None = None


class Reader:
    """One connection to a gateway, for reading its stream logs.

    Use as ``async with Reader("host:port") as reader: ...``.

    Args:
        address: the gateway, ``"host:port"``, ``"unix:PATH"`` or ``(host, port)``.
        buffer_bytes: guarantees issued per channel: how much the gateway may
            send ahead of what the application has taken.
        client_name: sent in Hello, for the gateway's logs.
        connect_timeout: seconds to open the connection and get Welcome.
        security: the token and TLS settings (:class:`ClientSecurity`), the
            way every client takes them; None: plain TCP without a token.
            On a gateway with a tokens file, the token's ``read`` patterns
            decide what the reader may fetch, subscribe to and list,
            ``admin`` whether it may release. Its token is read, and its TLS
            files loaded, at each ``connect``.

    While connected, the reader Pings the gateway at a third of the idle
    timeout its Welcome announces, so a quiet reader is not closed as idle;
    a gateway that says nothing (not even a Pong) for the whole idle timeout
    is gone, and every call then raises :class:`ReaderError`.
    """

    def __init__(
        self,
        address: str | tuple[str, int] | GatewayAddress,
        *,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        client_name: str = "headgate-reader",
        connect_timeout: float = 10.0,
        security: ClientSecurity | None = None,
    ) -> None:
        try:
            self.address = GatewayAddress.parse(address)
        except ConfigError as error:
            raise ReaderError(str(error)) from None
        self._where = str(self.address)
        self._security = security or ClientSecurity()
        try:
            self._security.check_address(self.address)
        except SecurityError as error:
            raise ReaderError(str(error)) from None
        if buffer_bytes < batch_cost(m.TAIL_HEADER_SIZE + 8):
            raise ValueError(f"buffer_bytes {buffer_bytes} is too small for any batch")
        self._buffer_bytes = buffer_bytes
        self._client_name = client_name
        self._connect_timeout = connect_timeout
        self._session = Session(
            Role.PRODUCER,
            max_message_size=MAX_MESSAGE_SIZE,
            data_cost=batch_cost,
            now=time.monotonic(),
        )
        self._link: GatewayLink | None = None
        self._welcome: asyncio.Future[m.Welcome] | None = None
        self._error: ReaderError | None = None
        self._ids = itertools.count(1)
        # Requests that wait for the gateway's next BindStream, in order.
        self._to_bind: deque[_Channel] = deque()
        self._fetch_channels: dict[str, _Channel] = {}
        self._by_handle: dict[int, _Channel] = {}
        self._fetches: dict[int, _Fetch] = {}
        self._lists: dict[int, asyncio.Future[m.StreamList | m.StreamDescriptions]] = {}
        self._consumer_requests: dict[int, asyncio.Future[int]] = {}
        self._consumer_lists: dict[int, asyncio.Future[m.ConsumerList]] = {}
        self._record_counts: dict[int, asyncio.Future[m.RecordCounts]] = {}
        self._fetch_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        #: The gateway's Welcome, once connected.
        self.welcome: m.Welcome | None = None
        #: Where the last completed fetch says the next one should start.
        self.last_next_position: int | None = None
        #: Bytes the last fetch of a ``skip`` consumer jumped over (freed
        #: before it read them); 0 for other fetches.
        self.last_skipped_bytes = 0
        #: Records among them, or None where the gateway could not count them.
        self.last_skipped_records: int | None = 0

    # -- connection ---------------------------------------------------------------

    async def connect(self) -> None:
        """Open the connection; ReaderError names the address if it cannot be."""
        loop = asyncio.get_running_loop()
        self._welcome = loop.create_future()
        try:
            token = self._security.token_bytes()
            context = self._security.ssl_context()
        except SecurityError as error:
            raise ReaderError(f"gateway {self._where}: {error}") from None
        self._session.send_global(
            m.Hello(producer_id=0, client_name=self._client_name, token=token)
        )
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, self._link = await self.address.connect(
                    lambda: GatewayLink(self, self._session),
                    ssl=context,
                    server_hostname=self._security.server_name,
                )
                await self._welcome
        except TimeoutError:
            self._abort()
            raise ReaderError(
                f"gateway {self._where}: no answer within {self._connect_timeout:g} s"
            ) from None
        except OSError as error:
            self._abort()
            reason = describe_tls_failure(error)
            if reason is not None:
                raise ReaderError(f"gateway {self._where}: {reason}") from None
            reason = error.strerror or str(error) or type(error).__name__
            raise ReaderError(f"cannot connect to gateway {self._where}: {reason}") from None
        except ReaderError:
            self._abort()
            raise

    async def close(self) -> None:
        """Say goodbye and close."""
        link = self._link
        if link is None or link.transport is None:
            return
        if self._error is None and not self._session.closed:
            self._session.send_global(m.Goodbye(code=ErrorCode.NONE))
            link.flush()
        self._fail(ReaderError(f"the reader of gateway {self._where} is closed"))
        link.close()

    def _abort(self) -> None:
        if self._link is not None:
            self._link.abort()

    async def __aenter__(self) -> Reader:
        await self.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _write(self) -> None:
        if self._link is not None:
            self._link.flush()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._link is None:
            raise ReaderError(f"the reader of gateway {self._where} is not connected")

    # -- incoming -----------------------------------------------------------------

    # The link's reports (headgate.client.link.LinkOwner).

    def link_events(self, link: GatewayLink, events: Iterable[Event]) -> None:
        if self._error is not None:
            return
        for event in events:
            match event:
                case WelcomeReceived(welcome=welcome):
                    self._session.grant(m.STREAM_CHANNEL, BIND_BUFFER_BYTES)
                    self.welcome = welcome
                    link.start_timer()
                    if self._welcome is not None and not self._welcome.done():
                        self._welcome.set_result(welcome)
                case StreamBound(handle=handle, stream=stream):
                    if not self._to_bind or self._to_bind[0].stream != stream:
                        self._fail(
                            ReaderError(
                                f"gateway {self._where} bound stream {stream!r}, "
                                "which no request of this reader asked for"
                            )
                        )
                        return
                    channel = self._to_bind.popleft()
                    channel.handle = handle
                    self._by_handle[handle] = channel
                    self._session.grant(m.data_channel(handle), self._buffer_bytes)
                case TailReceived():
                    target = self._by_handle.get(event.handle)
                    if target is None:  # we grant only bound handles; cannot happen
                        self._fail(
                            ReaderError(f"gateway {self._where} sent data on an unknown handle")
                        )
                        return
                    batch = TailBatch(
                        event.stream, event.header, event.record_count, bytes(event.records)
                    )
                    target.items.append((batch, event.size))
                    target.wake.set()
                case MessageReceived(message=message):
                    self._on_message(message)
                case _:
                    pass
        link.flush()

    def link_broken(self, link: GatewayLink, error: ProtocolError) -> None:
        self._fail(ReaderError(f"gateway {self._where} broke the protocol: {error}"))

    def link_expired(self, link: GatewayLink, reason: str) -> None:
        self._fail(ReaderError(f"gateway {self._where}: {reason}"))

    def link_drained(self, link: GatewayLink) -> None:
        pass  # a reader writes only requests, which the transport buffers

    def _on_message(self, message: m.GlobalMessage) -> None:
        match message:
            case m.FetchDone(request_id=request_id):
                fetch = self._fetches.get(request_id)
                if fetch is not None:
                    fetch.done = message
                    self._changed.set()
            case m.StreamList(request_id=request_id) | m.StreamDescriptions(request_id=request_id):
                future = self._lists.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(message)
            case m.ConsumerList(request_id=request_id):
                listed = self._consumer_lists.pop(request_id, None)
                if listed is not None and not listed.done():
                    listed.set_result(message)
            case m.RecordCounts(request_id=request_id):
                counted = self._record_counts.pop(request_id, None)
                if counted is not None and not counted.done():
                    counted.set_result(message)
            case m.ConsumerPosition(request_id=request_id, position=position):
                declared = self._consumer_requests.pop(request_id, None)
                if declared is not None and not declared.done():
                    declared.set_result(position)
            case m.Missed(handle=handle, count=count):
                channel = self._by_handle.get(handle)
                if channel is not None:
                    channel.items.append((MissedBatches(count), 0))
                    channel.wake.set()
            case _:
                pass

    def link_ending(self, link: GatewayLink, message: m.Goodbye | m.Error) -> None:
        """The gateway ended the session (the lifecycle's rule): every call fails now.

        (The gateway scopes an Error to a handle only for a writer's stream,
        so a reader only ever hears Errors about its whole session.)
        """
        code, text = message.code, message.text
        if isinstance(message, m.Error):
            self._fail(
                ReaderRefused(f"gateway {self._where} refused: {text} ({code.name})", code, text)
            )
        else:
            why = "" if code == ErrorCode.NONE else f": {text} ({code.name})"
            self._fail(ReaderError(f"gateway {self._where} closed the connection{why}"))

    def link_lost(self, link: GatewayLink, exc: Exception | None) -> None:
        detail = f" ({exc})" if exc else ""
        self._fail(ReaderError(f"gateway {self._where} closed the connection{detail}"))

    def _fail(self, error: ReaderError) -> None:
        if self._error is not None:
            return
        self._error = error
        if self._link is not None:
            self._link.stop_timer()
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(error)
        for future in self._lists.values():
            if not future.done():
                future.set_exception(error)
        self._lists.clear()
        for declared in self._consumer_requests.values():
            if not declared.done():
                declared.set_exception(error)
        self._consumer_requests.clear()
        for listed in self._consumer_lists.values():
            if not listed.done():
                listed.set_exception(error)
        self._consumer_lists.clear()
        for counted in self._record_counts.values():
            if not counted.done():
                counted.set_exception(error)
        self._record_counts.clear()
        self._changed.set()
        for channel in [*self._by_handle.values(), *self._to_bind]:
            channel.wake.set()

    # -- taking what arrived ---------------------------------------------------------

    async def _next(self, channel: _Channel) -> TailBatch | MissedBatches | None:
        """The next item of ``channel``, or None if nothing came before ``_changed``."""
        while not channel.items:
            self._check()
            channel.wake.clear()
            waiter = asyncio.ensure_future(channel.wake.wait())
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({waiter, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                changed.cancel()
            if not channel.items:
                self._check()
                return None
        item, size = channel.items.popleft()
        if size and channel.handle is not None and self._error is None:
            # Taken: its space in our buffer is free for the gateway again.
            self._session.process(channel.handle)
            data_channel = m.data_channel(channel.handle)
            state = self._session.inbound(data_channel)
            if state.issuable >= min(self._buffer_bytes // 4, state.capacity):
                self._session.issue(data_channel)
            if not channel.items:
                self._session.issue(data_channel)
            self._write()
        return item

    # -- requests -------------------------------------------------------------------

    async def list_streams(self) -> list[m.StreamInfo]:
        """Every stream of the gateway with its positions, sorted by name."""
        answer = await self._ask(m.ListStreams(request_id=next(self._ids)))
        if not isinstance(answer, m.StreamList):
            raise ReaderError(f"gateway {self._where} answered ListStreams with {answer!r}")
        return list(answer.streams)

    async def describe_streams(self) -> list[m.StreamDescription]:
        """Every stream of the gateway with its positions and when its consumer
        last released it, sorted by name.

        A gateway that predates DescribeStreams refuses it and closes the
        connection (:class:`ReaderError` with code ``MALFORMED_MESSAGE``); ask
        again with :meth:`list_streams` on a new Reader.
        """
        answer = await self._ask(m.DescribeStreams(request_id=next(self._ids)))
        if not isinstance(answer, m.StreamDescriptions):
            raise ReaderError(f"gateway {self._where} answered DescribeStreams with {answer!r}")
        return list(answer.streams)

    async def _ask(
        self, request: m.ListStreams | m.DescribeStreams
    ) -> m.StreamList | m.StreamDescriptions:
        self._check()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[m.StreamList | m.StreamDescriptions] = loop.create_future()
        self._lists[request.request_id] = future
        self._session.send_global(request)
        self._write()
        return await future

    async def fetch(
        self,
        stream: str,
        start: int,
        end: int | None = None,
        *,
        max_bytes: int = 0,
        consumer: str | None = None,
    ) -> AsyncGenerator[TailBatch, None]:
        """Yield the stored batches of ``stream`` in ``[start, end)``, in log order.

        ``end`` None reads to the durable end as of the request. With
        ``max_bytes``, stops after about that many bytes of log (at least one
        batch). Batches arrive only as fast as they are taken. One fetch runs
        at a time per reader; others wait their turn. A fetch left early
        still receives (and discards) the rest of what it asked for, so keep
        early exits to fetches limited by ``end`` or ``max_bytes``.

        With ``consumer``, the fetch reads as that named consumer: a start
        the log has freed already fails (``DATA_LOST``) or, for a ``skip``
        consumer, reads on from the oldest held position, and
        :attr:`last_skipped_bytes` says how many bytes were skipped.
        """
        if not m.is_valid_name(stream):
            raise ValueError(f"{stream!r} is not a valid stream name")
        async with self._fetch_lock:
            self._check()
            channel = self._fetch_channels.get(stream)
            if channel is None:
                channel = _Channel(stream)
                self._fetch_channels[stream] = channel
                self._to_bind.append(channel)
            request_id = next(self._ids)
            fetch = _Fetch(request_id)
            self._fetches[request_id] = fetch
            try:
                self._session.send_global(
                    m.Fetch(
                        request_id=request_id,
                        stream=stream,
                        start_position=start,
                        end_position=U64_MAX if end is None else end,
                        max_bytes=max_bytes,
                        consumer=consumer,
                    )
                )
            except ValueError as error:
                del self._fetches[request_id]
                raise ValueError(f"cannot fetch {stream!r}: {error}") from None
            self._write()
            taken = 0
            try:
                while fetch.done is None or taken < fetch.done.batches:
                    item = await self._next(channel)
                    if item is None:
                        continue  # FetchDone (or an error) arrived; look again
                    assert isinstance(item, TailBatch)
                    taken += 1
                    yield item
                self.last_next_position = fetch.done.next_position
                self.last_skipped_bytes = fetch.done.skipped_bytes or 0
                self.last_skipped_records = (
                    0 if fetch.done.skipped_bytes is None else fetch.done.skipped_records
                )
            finally:
                # Abandoned early: the rest of this fetch still arrives on the
                # stream's channel, ahead of the next fetch's batches; take it.
                with contextlib.suppress(ReaderError):
                    while self._error is None and (
                        fetch.done is None or taken < fetch.done.batches
                    ):
                        if await self._next(channel) is not None:
                            taken += 1
                self._fetches.pop(request_id, None)

    async def fetch_all(
        self,
        stream: str,
        start: int,
        end: int | None = None,
        *,
        max_bytes: int = 0,
        consumer: str | None = None,
    ) -> tuple[list[TailBatch], int]:
        """All batches of a fetch, and the position where a next fetch starts."""
        batches = [
            b async for b in self.fetch(stream, start, end, max_bytes=max_bytes, consumer=consumer)
        ]
        assert self.last_next_position is not None
        return batches, self.last_next_position

    def subscribe(
        self,
        stream: str,
        start: m.StartAt | int = m.StartAt.NOW,
        *,
        sample_every: int = 1,
    ) -> Subscription:
        """Subscribe to new batches of ``stream``; iterate the result with ``async for``.

        ``start``: ``StartAt.NOW``, ``StartAt.EARLIEST`` or a log position.
        With ``sample_every`` n, one batch in n. The tail is lossy: while the
        application does not take batches, the gateway skips them and a
        :class:`MissedBatches` tells how many, before the next batch. The Subscribe
        is sent at once.
        """
        self._check()
        channel = _Channel(stream)
        try:
            self._session.send_global(
                m.Subscribe(stream=stream, start=start, sample_every=sample_every)
            )
        except ValueError as error:
            raise ValueError(f"cannot subscribe to {stream!r}: {error}") from None
        self._to_bind.append(channel)
        self._write()
        return Subscription(self, channel)

    async def release(self, stream: str, position: int, consumer: str = m.DEFAULT_CONSUMER) -> None:
        """Tell the gateway ``consumer`` committed everything of ``stream`` before ``position``."""
        self._check()
        self._session.send_global(m.Release(stream=stream, position=position, consumer=consumer))
        self._write()

    async def reset_consumer(
        self, stream: str, consumer: str, to: m.ResetTo | int | m.ResetTime
    ) -> int:
        """Move ``consumer`` of ``stream`` (``admin``); its new position."""
        return await self._consumer_request(
            lambda request_id: m.ResetConsumer(
                request_id=request_id, stream=stream, consumer=consumer, to=to
            )
        )

    async def delete_consumer(self, stream: str, consumer: str) -> int:
        """Delete ``consumer`` of ``stream`` (``admin``); the position it had."""
        return await self._consumer_request(
            lambda request_id: m.DeleteConsumer(
                request_id=request_id, stream=stream, consumer=consumer
            )
        )

    async def _consumer_request(self, make: Callable[[int], m.GlobalMessage]) -> int:
        """Send a consumer request; the position its ConsumerPosition answer carries."""
        self._check()
        request_id = next(self._ids)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._consumer_requests[request_id] = future
        self._session.send_global(make(request_id))
        self._write()
        return await future

    async def list_consumers(self, stream: str) -> list[m.ConsumerInfo]:
        """The consumers of ``stream`` with their positions and lag, sorted by name."""
        self._check()
        request_id = next(self._ids)
        future: asyncio.Future[m.ConsumerList] = asyncio.get_running_loop().create_future()
        self._consumer_lists[request_id] = future
        self._session.send_global(m.ListConsumers(request_id=request_id, stream=stream))
        self._write()
        return list((await future).consumers)

    async def count_records(
        self, stream: str, positions: Sequence[int]
    ) -> tuple[int, tuple[int | None, ...]]:
        """The gateway's record counts at ``positions`` of ``stream``: ``(epoch, counts)``.

        Records between two positions are the difference of their counts
        (of one epoch); None where the gateway cannot count (CountRecords).
        At most :data:`~headgate.protocol.messages.MAX_COUNTED_POSITIONS`.
        """
        self._check()
        request_id = next(self._ids)
        future: asyncio.Future[m.RecordCounts] = asyncio.get_running_loop().create_future()
        self._record_counts[request_id] = future
        self._session.send_global(
            m.CountRecords(request_id=request_id, stream=stream, positions=tuple(positions))
        )
        self._write()
        answer = await future
        return answer.epoch, answer.counts

    async def declare_consumer(
        self, stream: str, consumer: str, *, blocking: bool = True, skip_data_loss: bool = False
    ) -> int:
        """Create consumer ``consumer`` of ``stream`` (or find it); its committed position.

        Needs ``admin`` or a ``consume`` pattern matching ``stream/consumer``.
        A new consumer starts at the oldest position the log holds.
        """
        return await self._consumer_request(
            lambda request_id: m.DeclareConsumer(
                request_id=request_id,
                stream=stream,
                consumer=consumer,
                blocking=blocking,
                skip_data_loss=skip_data_loss,
            )
        )


class Subscription:
    """A live tail of one stream: ``async for item in subscription`` gives
    :class:`TailBatch` and :class:`MissedBatches` items, in the order the gateway sent them."""

    def __init__(self, reader: Reader, channel: _Channel) -> None:
        self._reader = reader
        self._channel = channel

    @property
    def stream(self) -> str:
        return self._channel.stream

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> TailBatch | MissedBatches:
        while True:
            item = await self._reader._next(self._channel)
            if item is not None:
                return item


class SyncReader:
    """The :class:`Reader` for code without an event loop (a Spark executor).

    It runs a private event loop only while one of its calls runs, in the
    calling thread; between calls, TCP holds what the gateway sent. Not for
    use from a thread whose event loop is running. It takes the options of
    :class:`Reader` (``security``, ``buffer_bytes``, ...).

    Between calls nothing Pings the gateway, so a call that comes after more
    than half the gateway's idle timeout opens a new connection first (the
    gateway may have closed the old one as idle).
    """

    def __init__(self, address: str | tuple[str, int] | GatewayAddress, **options: object) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("SyncReader cannot run inside an event loop; use Reader")
        self._address = address
        self._options = options
        self._loop = asyncio.new_event_loop()
        try:
            self._reader = self._run(self._make(address, options))
            self._run(self._reader.connect())
        except BaseException:
            self._loop.close()
            raise
        #: New connections opened because the previous one sat idle too long.
        self.reconnects = 0

    @staticmethod
    async def _make(
        address: str | tuple[str, int] | GatewayAddress, options: dict[str, object]
    ) -> Reader:
        return Reader(address, **options)  # type: ignore[arg-type]

    def _run(self, coroutine: Awaitable[T]) -> T:
        return self._loop.run_until_complete(coroutine)

    def _fresh(self) -> Reader:
        """The reader, on a new connection if the old one idled past half the timeout."""
        # (The lifecycle's rule for a session whose clocks stood still.)
        if not self._reader._session.lifecycle.stale(time.monotonic()):
            return self._reader
        old = self._reader
        with contextlib.suppress(ReaderError, OSError):
            self._run(old.close())
        self._reader = self._run(self._make(self._address, self._options))
        self._run(self._reader.connect())
        self.reconnects += 1
        return self._reader

    def list_streams(self) -> list[m.StreamInfo]:
        return self._run(self._fresh().list_streams())

    def describe_streams(self) -> list[m.StreamDescription]:
        return self._run(self._fresh().describe_streams())

    def fetch(
        self, stream: str, start: int, end: int | None = None, *, max_bytes: int = 0
    ) -> Generator[TailBatch, None, None]:
        """As :meth:`Reader.fetch`, as a plain generator (``close()`` it to stop early)."""
        batches = self._fresh().fetch(stream, start, end, max_bytes=max_bytes)
        try:
            while True:
                try:
                    yield self._run(anext(batches))
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._run(batches.aclose())

    def fetch_all(
        self, stream: str, start: int, end: int | None = None, *, max_bytes: int = 0
    ) -> tuple[list[TailBatch], int]:
        """As :meth:`Reader.fetch_all`."""
        return self._run(self._fresh().fetch_all(stream, start, end, max_bytes=max_bytes))

    def release(self, stream: str, position: int) -> None:
        self._run(self._fresh().release(stream, position))

    def count_records(
        self, stream: str, positions: Sequence[int]
    ) -> tuple[int, tuple[int | None, ...]]:
        """As :meth:`Reader.count_records`."""
        return self._run(self._fresh().count_records(stream, positions))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._reader.close())
            # Let the transport write its Goodbye and close.
            self._run(asyncio.sleep(0))
        finally:
            self._loop.close()

    def __enter__(self) -> SyncReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
