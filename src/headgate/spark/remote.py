"""Reading through a gateway: what a cluster does when executors cannot see the disk.

The driver plans from the gateway (:class:`GatewayLogs`, the same interface
as :class:`~headgate.spark.planning.StreamLogs`): ListStreams gives every
stream's start, durable end and term length; admission control reads frame
headers with Fetch. Executors (:func:`read_remote_slice`) fetch their slices
over the network and decode them with the same vectorised decoder as a local
read. Nothing here opens the data directory.

Spark runs these in plain Python worker processes with no event loop, so both
use :class:`~headgate.client.reader.SyncReader`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from headgate.spark.decode import (
    BATCH_RECORDS,
    PAGE_LOG_BYTES,
    SourceError,
    StreamSlice,
    frames_to_batch,
)
from headgate.spark.planning import SCAN_PAGE_BYTES, StreamSelection

if TYPE_CHECKING:
    import pyarrow as pa

    from headgate.client.reader import SyncReader
    from headgate.client.security import ClientSecurity
    from headgate.protocol.messages import StreamInfo

log = logging.getLogger("headgate.spark")

#: A stream list younger than this is reused rather than asked for again.
LIST_FRESH_S = 0.05
#: How long an executor's read of a slice tries its gateway again after a
#: connection that cannot be opened or is lost (a gateway restarting).
READ_RETRY_S = 30.0


def _connect(gateway: str, security: ClientSecurity | None) -> SyncReader:
    from headgate.client.reader import ReaderError, SyncReader

    try:
        return SyncReader(
            gateway, client_name="headgate-spark", connect_timeout=10.0, security=security
        )
    except ReaderError as error:
        raise SourceError(f"headgate: cannot read through gateway {gateway}: {error}") from None


class GatewayLogs:
    """The driver's view of a gateway's streams; the interface of ``StreamLogs``."""

    def __init__(
        self, gateway: str, selection: StreamSelection, security: ClientSecurity | None = None
    ) -> None:
        self.gateway = gateway
        self.selection = selection
        self.security = security
        self._reader: SyncReader | None = None
        self._infos: dict[str, StreamInfo] = {}
        self._listed_at = float("-inf")

    def _client(self) -> SyncReader:
        if self._reader is None:
            self._reader = _connect(self.gateway, self.security)
        return self._reader

    def _call(self, what: str, call: Any) -> Any:
        from headgate.client.reader import ReaderError

        for attempt in (1, 2):
            try:
                return call(self._client())
            except ReaderError as error:
                self._drop_reader()
                if attempt == 2:
                    raise SourceError(
                        f"headgate: gateway {self.gateway}: {what} failed: {error}"
                    ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _refresh(self) -> None:
        infos = self._call("listing streams", lambda r: r.list_streams())
        self._infos = {i.stream: i for i in infos}
        self._listed_at = time.monotonic()

    def _info(self, stream: str, *, read_up_to: int | None = None) -> StreamInfo:
        if time.monotonic() - self._listed_at > LIST_FRESH_S:
            self._refresh()
        info = self._infos.get(stream)
        if info is None:
            where = "" if read_up_to is None else f" (the query has read it up to {read_up_to})"
            raise SourceError(f"stream {stream!r}: gateway {self.gateway} does not hold it{where}")
        return info

    def discover(self) -> list[str]:
        self._refresh()
        return sorted(s for s in self._infos if self.selection.matches(s))

    def names(self) -> list[str]:
        """Every stream the gateway listed last, selected or not, sorted: for messages."""
        return sorted(self._infos)

    def where(self) -> str:
        """Where the logs are, for messages."""
        return f"gateway {self.gateway}"

    def earliest(self, stream: str) -> int:
        return self._info(stream).start_position

    def latest(self, stream: str, *, read_up_to: int | None = None) -> int:
        return self._info(stream, read_up_to=read_up_to).durable_position

    def term_length(self, stream: str) -> int:
        return self._info(stream).term_length

    def check_retained(self, stream: str, start: int, end: int) -> None:
        info = self._info(stream)
        if start < info.start_position:
            raise SourceError(
                f"stream {stream!r}: position {start} was already released; the oldest "
                f"position gateway {self.gateway} retains is {info.start_position}"
            )
        if end > info.tail_position:
            raise SourceError(
                f"stream {stream!r}: position {end} is past the end of the log at gateway "
                f"{self.gateway} ({info.tail_position}); was the log recreated?"
            )

    def count_records(
        self, stream: str, positions: tuple[int, ...]
    ) -> tuple[int, tuple[int | None, ...]]:
        """The gateway's record counts at ``positions`` (CountRecords); SourceError if it fails."""
        return self._call(  # type: ignore[no-any-return]
            "counting records", lambda r: r.count_records(stream, positions)
        )

    def frames(self, stream: str, start: int, end: int) -> Iterator[Any]:
        """Frames in ``[start, end)``, fetched a page at a time (admission stops early)."""
        from headgate.client.reader import ReaderError

        position = start
        while position < end:
            try:
                page, position = self._client().fetch_all(
                    stream, position, end, max_bytes=SCAN_PAGE_BYTES
                )
            except ReaderError as error:
                self._drop_reader()
                raise SourceError(
                    f"stream {stream!r}: fetching [{position}, {end}) from gateway "
                    f"{self.gateway} failed: {error}"
                ) from None
            if not page:
                return  # only padding is left before ``end``
            for batch in page:
                yield batch.to_frame()

    def _drop_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            # The connection may already be broken; closing it is all that is left.
            with contextlib.suppress(Exception):
                reader.close()

    def close(self) -> None:
        self._drop_reader()


def read_remote_slice(
    gateway: str,
    piece: StreamSlice,
    schema: pa.Schema,
    *,
    page_bytes: int = PAGE_LOG_BYTES,
    security: ClientSecurity | None = None,
    retry_for: float = READ_RETRY_S,
) -> Iterator[pa.RecordBatch]:
    """Fetch one stream slice from ``gateway``; yield batches of at most BATCH_RECORDS rows.

    A connection that cannot be opened, or is lost while reading (the gateway
    restarts), is tried again for ``retry_for`` seconds (pauses from 0.1 s
    to 2 s), from the first page not yet yielded, so that no row is yielded
    twice: a Spark task (which local mode does not retry) outlives a gateway
    restart. A refusal (a released position, a token that may not read the
    stream) is not tried again. Either way the error is a SourceError.
    """
    from headgate.client.backoff import Backoff
    from headgate.client.reader import ReaderError, ReaderRefused

    # Where the first page not yet yielded starts; rows before it are out.
    page_start = piece.start
    backoff: Backoff | None = None
    while True:
        try:
            for batch in _fetch_pages(gateway, piece, page_start, schema, page_bytes, security):
                if backoff is not None:
                    backoff = None  # a page came: the next failure starts a fresh deadline
                page_start, rows = batch
                yield from _slices(rows)
            return
        except ReaderRefused as error:
            raise SourceError(_fetch_failed(gateway, piece, error)) from None
        except ReaderError as error:
            now = time.monotonic()
            if backoff is None:
                backoff = Backoff(now, give_up_after=retry_for, first=0.1)
            pause = backoff.failed(now)
            if pause is None:
                raise SourceError(
                    f"{_fetch_failed(gateway, piece, error)} (tried again for {retry_for:g} s)"
                ) from None
            log.warning(
                "stream %s: %s; trying again from position %d", piece.stream, error, page_start
            )
            time.sleep(pause)


def _fetch_failed(gateway: str, piece: StreamSlice, error: Exception) -> str:
    return (
        f"stream {piece.stream!r}: fetching positions {piece.start} to {piece.end} "
        f"from gateway {gateway} failed: {error}"
    )


def _fetch_pages(
    gateway: str,
    piece: StreamSlice,
    start: int,
    schema: pa.Schema,
    page_bytes: int,
    security: ClientSecurity | None,
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """The slice from ``start`` on one connection, decoded a page at a time: each page's
    rows with the position the next page starts at. Raises ReaderError."""
    from headgate.client.reader import SyncReader

    reader = SyncReader(
        gateway, client_name="headgate-spark", connect_timeout=10.0, security=security
    )
    try:
        batches = reader.fetch(piece.stream, start, piece.end)
        page: list[Any] = []
        page_start = start

        def decoded() -> pa.RecordBatch:
            skip = piece.skip if page_start == piece.start else 0
            return frames_to_batch(piece.stream, page, schema, skip=skip)

        try:
            for batch in batches:
                page.append(batch.to_frame())
                if batch.end_position - page_start >= page_bytes:
                    rows = decoded()
                    page, page_start = [], batch.end_position
                    yield page_start, rows
            if page:
                yield piece.end, decoded()
        finally:
            batches.close()
    finally:
        reader.close()


def _slices(batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    for first in range(0, batch.num_rows, BATCH_RECORDS):
        yield batch.slice(first, BATCH_RECORDS)
