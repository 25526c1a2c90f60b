"""A blocking producer for code without an event loop.

:class:`SyncProducer` runs an asyncio :class:`~headgate.client.Producer` (or,
for a fleet, a :class:`~headgate.client.FleetProducer`) on its own event
loop in a background thread (:mod:`headgate.client.background_loop`).
``send`` only appends to a deque (thread-safe under the GIL without a lock);
the loop is woken once per ``handoff_records`` records or once per linger
period, not per record, and drains the deque into the producer in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, Unpack, cast, overload

from headgate.client.address import GatewayAddress
from headgate.client.background_loop import BackgroundLoop
from headgate.client.batches import record_bytes
from headgate.client.errors import ProducerError, StreamRefused
from headgate.client.fleet import (
    FleetBatchResult,
    FleetOptions,
    FleetProducer,
    FleetStatistics,
    PartitionUnavailable,
)
from headgate.client.producer import (
    BatchResult,
    Producer,
    ProducerOptions,
    ProducerStatistics,
)
from headgate.client.security import ClientSecurity
from headgate.cluster import Cluster

if TYPE_CHECKING:
    from collections.abc import Coroutine

    import pyarrow as pa

__all__ = ["SyncProducer"]

T = TypeVar("T")
# What statistics() returns (a ProducerStatistics, or a fleet's FleetStatistics)
# and what a send_many future resolves to (a BatchResult, or a fleet's
# FleetBatchResult). The defaults (PEP 696, for the type checker only: Python
# 3.11's TypeVar has none) keep a bare ``SyncProducer`` annotation meaning the
# single-gateway one.
if TYPE_CHECKING:
    from typing_extensions import TypeVar as TypeVarWithDefault

    S = TypeVarWithDefault("S", ProducerStatistics, FleetStatistics, default=ProducerStatistics)
    R = TypeVarWithDefault("R", BatchResult, FleetBatchResult, default=BatchResult)
else:
    S = TypeVar("S", ProducerStatistics, FleetStatistics)
    R = TypeVar("R", BatchResult, FleetBatchResult)


class _Many:
    """A send_many call queued among single records, so that order holds."""

    __slots__ = ("future", "keys", "values")

    def __init__(
        self, values: object, keys: object, future: concurrent.futures.Future[Any]
    ) -> None:
        self.values = values
        self.keys = keys
        self.future = future


class SyncProducer(Generic[S, R]):
    """The :class:`~headgate.client.Producer`, for threads; same options.

    Args:
        address: the gateway: ``"host:port"``, ``"unix:/path/to.sock"`` or
            ``(host, port)``; or a list of gateways to bootstrap a fleet from.
        cluster: a cluster file (or a loaded :class:`~headgate.cluster.Cluster`):
            a fleet (as a list for ``address``). A fleet runs a
            :class:`~headgate.client.FleetProducer`: ``statistics`` returns its
            :class:`~headgate.client.FleetStatistics`, a ``send_many`` future
            resolves to a :class:`~headgate.client.fleet.FleetBatchResult`, and
            ``partition_timeout``, ``producer_id``, ``security`` and ``spool``
            go to it with the other options.
        handoff_records: records buffered in the calling thread before the
            background loop is woken to take them.
        max_pending_records: beyond this many records not yet taken by the
            background loop, ``send`` blocks until it catches up. The loop
            stops taking a stream's records while the stream holds
            ``max_buffered_bytes`` the gateway has not acknowledged, so the
            records in memory are at most that per stream, plus these.
        connect_timeout: how long the constructor waits for the session.
        **options: passed to :class:`~headgate.client.Producer`.

    Errors of records already handed over (a refused stream, a record too
    large, a fleet's partition unavailable beyond ``partition_timeout``: such
    a record is not sent) are raised by the next :meth:`flush`; once the
    producer has given up, every call raises :class:`ProducerError`.
    """

    @overload
    def __init__(
        self: SyncProducer[ProducerStatistics, BatchResult],
        address: str | tuple[str, int] | GatewayAddress,
        *,
        handoff_records: int = 1000,
        max_pending_records: int = 200_000,
        connect_timeout: float | None = None,
        **options: Unpack[ProducerOptions],
    ) -> None: ...

    @overload
    def __init__(
        self: SyncProducer[FleetStatistics, FleetBatchResult],
        address: list[str] | None = None,
        *,
        cluster: str | os.PathLike[str] | Cluster | None = None,
        handoff_records: int = 1000,
        max_pending_records: int = 200_000,
        connect_timeout: float | None = None,
        producer_id: int | None = None,
        security: ClientSecurity | None = None,
        spool: str | os.PathLike[str] | None = None,
        partition_timeout: float = 30.0,
        **options: Unpack[FleetOptions],
    ) -> None: ...

    def __init__(
        self,
        address: str | tuple[str, int] | GatewayAddress | list[str] | None = None,
        *,
        handoff_records: int = 1000,
        max_pending_records: int = 200_000,
        connect_timeout: float | None = None,
        **options: Any,
    ) -> None:
        self._producer: Producer | FleetProducer
        if isinstance(address, list):
            self._producer = FleetProducer(address, **options)
        elif options.get("cluster") is not None:
            if address is not None:
                raise ValueError("give either the bootstrap addresses or the cluster file")
            self._producer = FleetProducer(**options)
        elif address is None:
            raise TypeError("a SyncProducer needs the gateway's address (or cluster=...)")
        else:
            options.pop("cluster", None)
            self._producer = Producer(address, **options)
        self._linger = max(self._producer.linger_ms / 1000.0, 0.001)
        self._handoff = max(1, handoff_records)
        self._max_pending = max(self._handoff, max_pending_records)
        self._pending: deque[tuple[str, Any, bytes | None]] = deque()
        self._count = 0
        self._fatal: ProducerError | None = None
        self._final: S | None = None
        self._deferred: list[Exception] = []
        self._space = threading.Condition()
        self._closed = False
        self._background = BackgroundLoop("headgate-sync-producer")
        self._loop = self._background.loop
        self._wake: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._drainer: asyncio.Task[None] | None = None
        try:
            self._call(self._start(), connect_timeout)
        except BaseException:
            self._stop_loop()
            raise

    @property
    def producer_id(self) -> int:
        """The producer id the gateway deduplicates by."""
        return self._producer.producer_id

    @property
    def producer_secret(self) -> bytes | None:
        """The secret that ties the producer id to this producer (see Producer)."""
        return self._producer.producer_secret

    # -- the calling thread's side ---------------------------------------------

    def send(self, stream: str, value: bytes, key: bytes | None = None) -> None:
        """Queue one record; blocks only when the background loop is far behind.

        It falls behind when a stream's buffer is full (``max_buffered_bytes``):
        then ``send`` blocks, as :meth:`Producer.send` waits.
        """
        if self._fatal is not None:
            raise self._fatal
        if type(value) is not bytes:
            value = record_bytes(value, "value")
        if key is not None and type(key) is not bytes:
            key = record_bytes(key, "key")
        self._pending.append((stream, value, key))
        self._count += 1
        if self._count >= self._handoff:
            self._count = 0
            self._hand_over()

    def send_many(
        self,
        stream: str,
        values: Sequence[bytes] | pa.Array | pa.ChunkedArray | pa.RecordBatch | pa.Table,
        keys: Sequence[bytes | None] | pa.Array | pa.ChunkedArray | None = None,
    ) -> concurrent.futures.Future[R]:
        """Queue many records (as :meth:`Producer.send_many`); the future resolves when durable."""
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise ProducerError("the producer is closed")
        future: concurrent.futures.Future[R] = concurrent.futures.Future()
        self._pending.append((stream, _Many(values, keys, future), None))
        self._count = 0
        self._hand_over()
        return future

    def flush(self, timeout: float | None = None) -> None:
        """Hand over everything queued and wait until all of it is durable.

        Raises:
            TimeoutError: not durable within ``timeout`` seconds (nothing is lost;
                flush again).
            StreamRefused: a stream was refused since the last flush.
            ProducerError: the producer gave up.
        """
        if self._fatal is not None:
            raise self._fatal
        self._call(self._flush(), timeout)
        self._raise_deferred()

    def close(self, timeout: float | None = None) -> None:
        """Flush, close the session and stop the background thread; idempotent."""
        if self._closed:
            return
        try:
            if self._fatal is None:
                self._call(self._close(), timeout)
                self._raise_deferred()
        finally:
            self._tear_down()

    def abort(self) -> None:
        """Close at once; records not yet acknowledged are lost."""
        if self._closed:
            return
        self._tear_down()

    def _tear_down(self) -> None:
        self._closed = True
        if self._loop.is_running():
            with contextlib.suppress(TimeoutError, ProducerError):
                self._call(self._producer.abort(), 5.0)
            # Taken on the loop: a fleet's snapshot reads the loop's clock.
            with contextlib.suppress(TimeoutError):
                self._final = self._call(self._statistics(), 5.0)
        self._stop_loop()
        if self._fatal is None:
            self._fatal = ProducerError("the producer is closed")

    def statistics(self) -> S:
        """A snapshot of the producer (as :meth:`Producer.statistics`); the last one once closed."""
        if self._closed:
            # The loop is gone; nothing changes any more.
            if self._final is not None:
                return self._final
            return cast("S", self._producer.statistics())
        return self._call(self._statistics(), 5.0)

    def __enter__(self) -> SyncProducer[S, R]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _hand_over(self) -> None:
        if self._closed:
            raise ProducerError("the producer is closed")
        wake = self._wake
        assert wake is not None
        self._loop.call_soon_threadsafe(wake.set)
        if len(self._pending) > self._max_pending:
            with self._space:
                while len(self._pending) > self._max_pending and self._fatal is None:
                    # The timeout only guards against a notification lost to
                    # a race; the drainer notifies as it makes room.
                    self._space.wait(0.5)
            if self._fatal is not None:
                raise self._fatal

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None) -> T:
        return self._background.run(coroutine, timeout)

    def _raise_deferred(self) -> None:
        if self._deferred:
            error = self._deferred.pop(0)
            self._deferred.clear()
            raise error

    def _stop_loop(self) -> None:
        self._background.stop()

    # -- the background loop's side -------------------------------------------------

    async def _start(self) -> None:
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        await self._producer.connect()
        self._drainer = asyncio.get_running_loop().create_task(self._drain_loop())

    async def _drain_loop(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            # Woken per handoff; otherwise every linger period, so that
            # records of a caller who stopped sending still go out.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self._linger)
            wake.clear()
            await self._drain()

    async def _drain(self) -> None:
        lock = self._lock
        assert lock is not None
        # One drainer at a time: a second one would interleave records.
        async with lock:
            pending = self._pending
            send = self._producer.send
            append = self._producer._append_nowait
            taken = 0
            while pending:
                stream, value, key = pending.popleft()
                try:
                    if key is None and append(stream, value):
                        pass
                    elif value.__class__ is _Many:
                        await self._send_many(stream, value)
                    else:
                        await send(stream, value, key)
                except StreamRefused as exc:
                    if not any(
                        isinstance(e, StreamRefused) and e.stream == exc.stream
                        for e in self._deferred
                    ):
                        self._deferred.append(exc)
                except PartitionUnavailable as exc:
                    # One gateway of a fleet is away: the others' records go on.
                    if not any(isinstance(e, PartitionUnavailable) for e in self._deferred):
                        self._deferred.append(exc)
                except ProducerError as exc:
                    self._fatal = exc
                    self._fail_pending(exc)
                    break
                except (TypeError, ValueError) as exc:
                    self._deferred.append(exc)
                taken += 1
                if taken >= self._handoff:
                    taken = 0
                    self._notify_space()
            self._notify_space()

    async def _send_many(self, stream: str, many: _Many) -> None:
        future = many.future
        try:
            delivery = await self._producer.send_many(
                stream,
                many.values,
                many.keys,
            )
        except Exception as exc:
            future.set_exception(exc)
            if isinstance(exc, ProducerError):
                raise
            return

        async def settle() -> None:
            try:
                future.set_result(await delivery)
            except Exception as exc:
                future.set_exception(exc)

        asyncio.get_running_loop().create_task(settle())

    def _fail_pending(self, error: ProducerError) -> None:
        while self._pending:
            _, value, _ = self._pending.popleft()
            if value.__class__ is _Many and not value.future.done():
                value.future.set_exception(error)

    def _notify_space(self) -> None:
        with self._space:
            self._space.notify_all()

    async def _flush(self) -> None:
        await self._drain()
        if self._fatal is not None:
            raise self._fatal
        await self._producer.flush()

    async def _close(self) -> None:
        await self._drain()
        if self._drainer is not None:
            self._drainer.cancel()
        await self._producer.close()

    async def _statistics(self) -> S:
        return cast("S", self._producer.statistics())
