"""Serving readers: Fetch, ListStreams and live Subscribe, on the down session.

A reader connects like a producer and asks with global messages; the answers
travel as TailRecords on data channels of stream handles that the gateway
binds in the down session, where the reader is the LCMUX server and issues
guarantees for its own buffer. PROTOCOL.md, "Serving readers", is the
contract; this module keeps it:

* A **fetch** is reliable and paced by the reader: frames are read from the
  log (which is on disk, so waiting costs no memory) and sent only within the
  reader's guarantees and while the socket buffer to the reader is below
  :data:`MAX_BACKLOG`. Without room it stops; guarantees arriving, or the
  socket draining, start it again.
* A **subscription** first reads history the same way, then follows appends
  live. Live delivery never waits: :meth:`ReaderConnection.deliver` either
  sends the batch at once or counts it as missed. Every batch a subscriber
  gets goes through :meth:`ReaderConnection.send_to_subscriber`, the one
  place where per-connection accounting can charge a delivery.

Everything served is charged to the reader's work budget (shared by its
token, see :mod:`headgate.gateway.budget`) with the connection's ``charge``:
a listing by the streams it lists, a fetch page by its frames and bytes, a
live delivery by its batch. One turn of serving sends at most
:data:`SERVE_TURN_FRAMES` frames and :data:`SERVE_TURN_BYTES`; while the
budget is in debt, serving waits for it, and live deliveries are missed.

Nothing here touches the event loop directly: the connection passes in how to
flush, how big its socket backlog is, and how to run something later.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from headgate.gateway.accounts import Account
from headgate.gateway.budget import Cost, PeerShare
from headgate.gateway.recovery import StreamRecovery
from headgate.gateway.streams import Stream
from headgate.log import LogError, LogFrame
from headgate.protocol import messages as m
from headgate.protocol.c64 import U64_MAX
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.session import Session

__all__ = ["MAX_BACKLOG", "ReaderConnection", "ReaderRequest", "TailHub", "TailSubscription"]

#: What a reader asks of the gateway that this module serves.
ReaderRequest = m.Fetch | m.Subscribe | m.ListStreams | m.DescribeStreams

log = logging.getLogger("headgate.gateway")

#: Bytes waiting in the socket buffer to a reader beyond which nothing more is
#: sent to it (a fetch pauses, a live tail misses batches).
MAX_BACKLOG = 256 * 1024
#: Log bytes one turn of serving reads before it lets the event loop run others.
SERVE_TURN_BYTES = 1 << 20
#: Frames one turn of serving sends (tiny frames cost per frame, not per byte).
SERVE_TURN_FRAMES = 256
#: Cost units (see budget.Cost) one turn of serving may spend.
SERVE_TURN_COST = 2000.0
#: Log bytes read from the log at a time.
READ_CHUNK_BYTES = 256 * 1024
#: Log bytes read at a time, at least.
MIN_READ_BYTES = 4096
#: Most fetches, and most listings, waiting their turn per connection
#: (subscriptions have their own limits in the configuration).
MAX_REQUESTS = 1024


@dataclass(eq=False)
class _FetchJob:
    request: m.Fetch
    #: Where the next frame to send starts.
    cursor: int
    #: Stop before this position.
    end: int
    #: TailRecords sent so far.
    sent: int = 0
    #: Bytes a ``skip`` consumer jumped over (freed before it read them).
    skipped: int = 0
    #: Records among them, or None where they could not be counted.
    skipped_records: int | None = 0
    #: Where the fetch started reading (``max_bytes`` counts from here).
    start: int = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.cursor


@dataclass(eq=False)
class TailSubscription:
    """One Subscribe: a lossy view of one stream for one reader connection."""

    #: The reader connection it belongs to.
    owner: ReaderConnection
    #: The stream's name.
    stream: str
    #: Deliver one considered batch in this many.
    sample_every: int
    #: Where the next stored frame to send starts (while catching up).
    cursor: int
    #: The gateway's handle for it in the down session, once bound.
    handle: int | None = None
    #: Whether it has caught up with the tail and follows appends.
    live: bool = False
    #: Batches considered so far (for sampling).
    seen: int = 0
    #: Batches skipped since the last TailRecords, told in the next Missed.
    missed: int = 0
    #: Batches delivered and missed in all, for statistics and tests.
    delivered_total: int = 0
    missed_total: int = 0

    def sampled_out(self) -> bool:
        """Count one more batch; whether sampling passes over it."""
        self.seen += 1
        return (self.seen - 1) % self.sample_every != 0


@dataclass
class TailHub:
    """Every live subscription of the gateway, by stream."""

    subscriptions: dict[str, list[TailSubscription]] = field(default_factory=dict)

    def add(self, sub: TailSubscription) -> None:
        self.subscriptions.setdefault(sub.stream, []).append(sub)

    def remove(self, sub: TailSubscription) -> None:
        subs = self.subscriptions.get(sub.stream)
        if subs is not None and sub in subs:
            subs.remove(sub)
            if not subs:
                del self.subscriptions[sub.stream]

    def on_append(
        self,
        stream: Stream,
        producer_id: int,
        first_sequence: int,
        records: memoryview,
        timestamp_us: int,
        account: Account | None = None,
    ) -> None:
        """A batch was just appended to ``stream``: offer it to each of its subscribers.

        Never waits and never buffers beyond what a subscriber's guarantees
        allow: each delivery is sent at once or counted as missed. The
        fan-out is charged to ``account`` (the producer's connection, whose
        batch caused it), one unit per subscriber, until every delivery has
        been handed to its subscriber's socket.
        """
        subs = self.subscriptions.get(stream.name)
        if not subs:
            return
        where = stream.last_append
        header = m.TailHeader(
            first_sequence, where.position, where.end_position, producer_id, timestamp_us
        )
        loan = None if account is None else account.loan(len(subs))
        try:
            owners = {}
            for sub in subs:
                if sub.owner.deliver(sub, header, records):
                    owners[id(sub.owner)] = sub.owner
            for owner in owners.values():
                owner.flush()
        finally:
            if loan is not None:
                loan.repay()


class ReaderConnection:
    """The reader side of one gateway connection: its fetches and subscriptions.

    Args:
        session: the connection's protocol session (gateway role).
        streams: the gateway's open streams, by name (never created here).
        hub: the gateway's live subscriptions.
        flush: writes out what the session has queued.
        backlog: bytes waiting in the socket buffer to the peer.
        later: runs a callable on the event loop after a delay in seconds (0: soon).
        fail: closes the connection with an Error (for failures outside
            event handling, where raising would reach nobody).
        recovery: the streams the gateway is still recovering after its
            start: requests that need one of them wait (see :meth:`recovered`).
        charge: pays units of work from the connection's budget; returns
            the seconds to wait before more is done for it (0: none).
        share: the budget share the connection pays from (for the
            subscriptions its token holds together).
        max_subscriptions: live subscriptions this connection may hold.
        subscriptions_per_token: live subscriptions one share may hold.
    """

    def __init__(
        self,
        session: Session,
        streams: Mapping[str, Stream],
        hub: TailHub,
        *,
        flush: Callable[[], None],
        backlog: Callable[[], int],
        later: Callable[[float, Callable[[], None]], object],
        fail: Callable[[ProtocolError], None],
        recovery: StreamRecovery | None = None,
        charge: Callable[[float], float] = lambda units: 0.0,
        share: Callable[[], PeerShare | None] = lambda: None,
        max_subscriptions: int = 64,
        subscriptions_per_token: int = 256,
    ) -> None:
        self._session = session
        self._streams = streams
        self._hub = hub
        self._flush = flush
        self._backlog = backlog
        self._later = later
        self._fail = fail
        self._recovery = recovery or StreamRecovery()
        # Requests waiting for streams being recovered, in arrival order
        # (with the ListStreams visibility of each).
        self._held: deque[tuple[ReaderRequest, Callable[[str], bool]]] = deque()
        self._charge = charge
        self._share = share
        self._max_subscriptions = max_subscriptions
        self._subscriptions_per_token = subscriptions_per_token
        #: The share that counts this connection's subscriptions.
        self._counted_in: PeerShare | None = None
        # What the serving turn in progress may still send, and has cost.
        self._frames_left = SERVE_TURN_FRAMES
        self._cost = 0.0
        # Log bytes per frame lately (sizes the reads; small until seen).
        self._frame_bytes = 64
        self._jobs: deque[_FetchJob] = deque()
        # ListStreams and DescribeStreams waiting for their turn, in order, and
        # who may see what.
        self._listings: deque[m.ListStreams | m.DescribeStreams] = deque()
        self._visible: Callable[[str], bool] = lambda name: True
        self._fetch_handles: dict[str, int] = {}
        # Requests that need a handle, in request order: a stream name (its
        # fetch handle) or a subscription. The k-th bind answers the k-th.
        self._to_bind: deque[str | TailSubscription] = deque()
        self._binding: set[str] = set()
        self.subscriptions: list[TailSubscription] = []
        self._scheduled = False
        self._out_of_room = False
        self._closed = False

    # -- requests ---------------------------------------------------------------

    def on_request(
        self,
        message: ReaderRequest,
        visible: Callable[[str], bool] = lambda name: True,
    ) -> None:
        """A reader's request arrived; raises ProtocolError for one that cannot be served.

        ``visible`` says which streams ListStreams and DescribeStreams show (those
        the peer may read).

        A request that needs a stream the gateway is still recovering waits,
        and so does every request after it (the requests of a connection are
        answered in order, and the k-th bind answers the k-th request that
        needs one): a Fetch or Subscribe of that stream, a ListStreams while
        any stream the peer may see is recovering.
        """
        if self._held or self._must_wait(message, visible):
            self._check_count(len(self._held), "requests waiting for recovering streams")
            self._held.append((message, visible))
            return
        self._accept(message, visible)

    def _must_wait(self, message: ReaderRequest, visible: Callable[[str], bool]) -> bool:
        recovery = self._recovery
        if isinstance(message, m.ListStreams | m.DescribeStreams):
            return any(visible(name) for name in recovery.names())
        if recovery.recovering(message.stream):
            recovery.want(message.stream)
            return True
        return False

    def recovered(self) -> None:
        """The gateway recovered a stream (or gave up on one): serve what waited for it.

        Raises:
            ProtocolError: a request that waited cannot be served after all.
        """
        while self._held and not self._must_wait(*self._held[0]):
            message, visible = self._held.popleft()
            self._accept(message, visible)

    def _accept(
        self,
        message: ReaderRequest,
        visible: Callable[[str], bool],
    ) -> None:
        match message:
            case m.ListStreams() | m.DescribeStreams():
                # Answered in a serving turn, within the budget: a listing
                # costs as much as the streams it walks, and a slice of
                # received bytes can hold thousands of requests.
                self._check_count(len(self._listings), "listings waiting")
                self._visible = visible
                self._listings.append(message)
            case m.Fetch():
                self._charge(Cost.FETCH)
                self._check_count(len(self._jobs), "fetches waiting")
                stream = self._stream(message.stream)
                start, skipped = message.start_position, 0
                skipped_records: int | None = 0
                if message.consumer is not None:
                    # Behind the log: the consumer's on_data_loss (an error, or skip ahead).
                    start, skipped, skipped_records = stream.read_start(message.consumer, start)
                end = message.end_position
                if end == U64_MAX:
                    # The durable end, or nothing if the reader is past it already.
                    end = max(stream.log.durable_position, start)
                elif skipped:
                    end = max(end, start)  # all it asked for was freed: nothing to read
                self._check_range(stream, start, end)
                if (
                    message.stream not in self._fetch_handles
                    and message.stream not in self._binding
                ):
                    self._binding.add(message.stream)
                    self._to_bind.append(message.stream)
                self._jobs.append(
                    _FetchJob(message, start, end, skipped=skipped, skipped_records=skipped_records)
                )
            case m.Subscribe():
                self._charge(Cost.SUBSCRIBE)
                self._check_subscriptions()
                stream = self._stream(message.stream)
                log_ = stream.log
                if message.start is m.StartAt.NOW:
                    start = log_.tail_position
                elif message.start is m.StartAt.EARLIEST:
                    start = log_.release_position
                else:
                    start = message.start
                    self._check_range(stream, start, log_.tail_position)
                sub = TailSubscription(
                    owner=self,
                    stream=message.stream,
                    sample_every=message.sample_every,
                    cursor=start,
                    live=start == log_.tail_position,
                )
                self.subscriptions.append(sub)
                self._count_subscription()
                self._to_bind.append(sub)
                self._hub.add(sub)
        self._bind()
        self.pump()

    def _info(self, stream: Stream) -> m.StreamInfo:
        log_ = stream.log
        return m.StreamInfo(
            stream=stream.name,
            start_position=log_.release_position,
            durable_position=log_.durable_position,
            tail_position=log_.tail_position,
            term_length=log_.term_length,
        )

    def _stream(self, name: str) -> Stream:
        stream = self._streams.get(name)
        failure = self._recovery.failure(name)
        if stream is None and failure is not None:
            raise ProtocolError(
                f"stream {name!r} could not be recovered: {failure}",
                code=ErrorCode.STORAGE_UNAVAILABLE,
            )
        if stream is None:
            raise ProtocolError(
                f"the gateway holds no stream called {name!r}", code=ErrorCode.UNEXPECTED_FRAME
            )
        return stream

    def _check_subscriptions(self) -> None:
        """Raise RESOURCE_EXHAUSTED if one more subscription is over a limit."""
        if len(self.subscriptions) >= self._max_subscriptions:
            raise ProtocolError(
                f"a connection may have at most {self._max_subscriptions} subscriptions",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        share = self._share()
        if share is not None and share.subscriptions >= self._subscriptions_per_token:
            raise ProtocolError(
                f"the peers of {share.key} hold their maximum of "
                f"{self._subscriptions_per_token} subscriptions",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )

    def _count_subscription(self) -> None:
        share = self._share()
        if share is None:
            return
        if self._counted_in is None:
            self._counted_in = share
        self._counted_in.subscriptions += 1

    @staticmethod
    def _check_count(count: int, what: str) -> None:
        if count >= MAX_REQUESTS:
            raise ProtocolError(
                f"a connection may have at most {MAX_REQUESTS} {what}",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )

    @staticmethod
    def _check_range(stream: Stream, start: int, end: int) -> None:
        log_ = stream.log
        if not log_.release_position <= start <= end <= log_.tail_position:
            raise ProtocolError(
                f"stream {stream.name!r}: cannot read [{start}, {end}); the log holds "
                f"[{log_.release_position}, {log_.tail_position})",
                code=ErrorCode.UNEXPECTED_FRAME,
            )

    def _bind(self) -> None:
        while self._to_bind:
            wanted = self._to_bind[0]
            name = wanted if isinstance(wanted, str) else wanted.stream
            handle = self._session.bind_stream(name)
            if handle is None:
                return  # no bind guarantees yet; GuaranteesReceived on 0 retries
            self._to_bind.popleft()
            if isinstance(wanted, str):
                self._binding.discard(wanted)
                self._fetch_handles[wanted] = handle
            else:
                wanted.handle = handle

    # -- flow ---------------------------------------------------------------------

    def on_guarantees(self, channel: int) -> None:
        """The reader issued guarantees (for binds, or for a data channel)."""
        if channel == m.STREAM_CHANNEL:
            self._bind()
        self.pump()

    def resume(self) -> None:
        """The socket buffer to the reader drained: go on sending."""
        self.pump()

    def _room(self) -> bool:
        if self._backlog() + self._session.pending_output < MAX_BACKLOG:
            return True
        self._out_of_room = True
        return False

    def pump(self) -> None:
        """Send what fetches and catching-up subscriptions can send now, then flush.

        One call is one turn: listings, then at most :data:`SERVE_TURN_FRAMES`
        frames and :data:`SERVE_TURN_BYTES` (and :data:`SERVE_TURN_COST`),
        charged to the reader's budget. More is served in a later turn,
        once other connections have run and, if the budget is in debt, once
        it is paid off.
        """
        if self._closed or self._session.closed:
            return
        if (
            not self._jobs
            and not self._listings
            and not any(not sub.live for sub in self.subscriptions)
        ):
            self.flush()
            return
        wait = self._charge(0.0)
        if wait > 0:
            self._again(wait)
            return
        budget = SERVE_TURN_BYTES
        self._frames_left = SERVE_TURN_FRAMES
        self._cost = 0.0
        self._out_of_room = False
        while self._listings and self._cost < SERVE_TURN_COST and self._room():
            self._list_streams(self._listings.popleft())
        if self._cost >= SERVE_TURN_COST:
            budget = 0
        while self._jobs and budget > 0 and self._frames_left > 0:
            job = self._jobs[0]
            handle = self._fetch_handles.get(job.request.stream)
            if handle is None:
                break
            done, used = self._serve_fetch(job, handle, budget)
            budget -= used
            if not done:
                break
            self._jobs.popleft()
            if job.request.consumer is not None:
                stream = self._streams.get(job.request.stream)
                if stream is not None:
                    stream.consumer_read(job.request.consumer, job.cursor)
            self._session.send_global(
                m.FetchDone(
                    request_id=job.request.request_id,
                    next_position=job.cursor,
                    batches=job.sent,
                    skipped_bytes=None if job.request.consumer is None else job.skipped,
                    skipped_records=None if job.request.consumer is None else job.skipped_records,
                )
            )
        for sub in self.subscriptions:
            if budget <= 0 or self._frames_left <= 0:
                break
            if not sub.live and sub.handle is not None:
                budget -= self._catch_up(sub, budget)
        wait = self._charge(self._cost) if self._cost else 0.0
        self._cost = 0.0
        self.flush()
        # More is ready (the turn ran out, or the output filled up and the
        # socket took it all at once, so no resume_writing will come): let
        # other connections run, then serve it.
        more = (
            budget <= 0
            or self._frames_left <= 0
            or bool(self._listings)
            or (self._out_of_room and self._room())
        )
        if more:
            self._again(wait)

    def _list_streams(self, request: m.ListStreams | m.DescribeStreams) -> None:
        """Answer one ListStreams or DescribeStreams: the streams the peer may read,
        with their positions (and, described, when each was last released)."""
        visible = self._visible
        shown = [s for name, s in sorted(self._streams.items()) if visible(name)]
        self._cost += Cost.LIST_STREAMS + Cost.LIST_ENTRY * len(self._streams)
        answer: m.StreamList | m.StreamDescriptions
        if isinstance(request, m.ListStreams):
            answer = m.StreamList(
                request_id=request.request_id, streams=tuple(self._info(s) for s in shown)
            )
        else:
            answer = m.StreamDescriptions(
                request_id=request.request_id,
                streams=tuple(
                    m.StreamDescription(info=self._info(s), released_at_us=s.released_at_us)
                    for s in shown
                ),
            )
        self._session.send_global(answer)

    def _again(self, delay: float) -> None:
        """Serve another turn after ``delay`` seconds (0: once others have run)."""
        if not self._scheduled:
            self._scheduled = True
            self._later(delay, self._continue)

    def _can_send(self, handle: int) -> bool:
        """Whether the reader has room for at least an empty TailRecords on ``handle``."""
        channel = self._session.outbound(m.data_channel(handle))
        return self._room() and channel.can_send(self._session.tail_cost(0))

    def _read(self, stream: Stream, start: int, end: int) -> list[LogFrame]:
        """Read about as many frames as this turn may still send (each read is charged).

        Reading a chunk of the log makes an object per frame, so a chunk of
        256 KiB of tiny frames is thousands of them: the chunk is sized by
        the frames left in the turn and the size of the frames read lately.

        Raises:
            LogError: the log cannot be read there.
        """
        want = int(self._frames_left * self._frame_bytes * 1.25)
        frames = stream.log.read(
            start, end, max_bytes=max(MIN_READ_BYTES, min(READ_CHUNK_BYTES, want))
        )
        if frames:
            self._frame_bytes = max(1, (frames[-1].end_position - start) // len(frames))
            self._cost += Cost.READ_FRAME * len(frames)
        return frames

    def _continue(self) -> None:
        self._scheduled = False
        try:
            self.pump()
        except ProtocolError as error:
            self._fail(error)

    def _sent(self, payload_bytes: int) -> None:
        """One frame was sent in this serving turn: count it, and what it cost."""
        self._frames_left -= 1
        self._cost += Cost.FETCH_FRAME + Cost.of_bytes(payload_bytes)

    def flush(self) -> None:
        self._flush()

    def _serve_fetch(self, job: _FetchJob, handle: int, budget: int) -> tuple[bool, int]:
        """Send frames of ``job`` within guarantees; (finished, log bytes used)."""
        request = job.request
        stream = self._stream(request.stream)
        limit = request.max_bytes or U64_MAX
        used = 0
        while job.cursor < job.end and used < budget:
            if not self._can_send(handle):
                return False, used  # read nothing that cannot be sent
            if request.consumer is not None and job.cursor < stream.log.release_position:
                # Freed while being served (a non-blocking consumer holds nothing).
                job.cursor, skipped, records = stream.read_start(request.consumer, job.cursor)
                job.skipped += skipped
                job.skipped_records = (
                    None
                    if records is None or job.skipped_records is None
                    else job.skipped_records + records
                )
                job.end = max(job.end, job.cursor)
                continue
            try:
                frames = self._read(stream, job.cursor, job.end)
            except LogError as error:
                raise ProtocolError(
                    f"stream {request.stream!r}: cannot fetch from position {job.cursor}: {error}",
                    code=ErrorCode.UNEXPECTED_FRAME,
                ) from None
            if not frames:
                job.cursor = job.end  # only padding was left
                break
            for frame in frames:
                if job.sent and frame.end_position - job.start > limit:
                    return True, used
                if self._frames_left <= 0 or not self._room():
                    return False, used
                if not self._session.send_tail(handle, _header(frame), frame.payload):
                    return False, used  # the reader's guarantees bring us back
                self._sent(len(frame.payload))
                job.sent += 1
                used += frame.end_position - job.cursor
                job.cursor = frame.end_position
        return job.cursor >= job.end, used

    def _catch_up(self, sub: TailSubscription, budget: int) -> int:
        """Send stored frames to a subscription behind the tail; log bytes used."""
        stream = self._streams.get(sub.stream)
        if stream is None:
            return 0
        assert sub.handle is not None
        used = 0
        while used < budget and self._frames_left > 0:
            tail = stream.log.tail_position
            if sub.cursor >= tail:
                sub.live = True
                return used
            if sub.cursor < stream.log.release_position:
                # Spark released history this subscriber had not read yet.
                sub.cursor = stream.log.release_position
                sub.missed += 1
                sub.missed_total += 1
                continue
            if not self._can_send(sub.handle):
                return used
            try:
                frames = self._read(stream, sub.cursor, tail)
            except LogError as error:
                raise ProtocolError(
                    f"stream {sub.stream!r}: cannot read from position {sub.cursor}: {error}",
                    code=ErrorCode.UNEXPECTED_FRAME,
                ) from None
            if not frames:
                sub.cursor = tail
                continue
            for frame in frames:
                if self._frames_left <= 0:
                    return used
                if not sub.sampled_out():
                    header = _header(frame)
                    if not self._room() or not self.send_to_subscriber(sub, header, frame.payload):
                        sub.seen -= 1  # it will be considered again
                        return used
                    self._sent(len(frame.payload))
                used += frame.end_position - sub.cursor
                sub.cursor = frame.end_position
        return used

    # -- live delivery -----------------------------------------------------------------

    def deliver(self, sub: TailSubscription, header: m.TailHeader, records: memoryview) -> bool:
        """Offer one appended batch to one live subscription; True if anything was queued.

        The one place a live batch reaches a subscriber. It sends at once, or
        skips and counts: a subscriber never makes ingestion wait, and nothing
        is buffered for it beyond its own guarantees and :data:`MAX_BACKLOG`.
        """
        if not sub.live or self._closed or self._session.closed:
            return False  # still reading history; this frame is in the log for it
        if sub.sampled_out():
            return False
        if (
            sub.handle is None
            or not self._room()
            or self._charge(0.0) > 0  # its reader's budget is spent: no work for it now
            or not self.send_to_subscriber(sub, header, records)
        ):
            sub.missed += 1
            sub.missed_total += 1
            return False
        self._charge(Cost.DELIVERY + Cost.of_bytes(len(records)))
        return True

    def send_to_subscriber(
        self, sub: TailSubscription, header: m.TailHeader, records: memoryview
    ) -> bool:
        """Send one batch to a subscriber now if its guarantees allow; else False.

        Every TailRecords a subscriber gets (live or catching up) goes through
        here, after the Missed it is owed: the one place to charge a delivery
        to the account of the connection that caused it.
        """
        assert sub.handle is not None
        channel = m.data_channel(sub.handle)
        if not self._session.outbound(channel).can_send(self._session.tail_cost(len(records))):
            return False
        if sub.missed:
            self._session.send_global(m.Missed(handle=sub.handle, count=sub.missed))
            sub.missed = 0
        sent = self._session.send_tail(sub.handle, header, records)
        assert sent  # can_send said so
        sub.delivered_total += 1
        return True

    def close(self) -> None:
        """The connection is gone: stop every subscription and fetch."""
        self._closed = True
        for sub in self.subscriptions:
            self._hub.remove(sub)
        if self._counted_in is not None:
            self._counted_in.subscriptions -= len(self.subscriptions)
            self._counted_in = None
        self.subscriptions.clear()
        self._jobs.clear()
        self._listings.clear()


def _header(frame: LogFrame) -> m.TailHeader:
    return m.TailHeader(
        frame.first_sequence,
        frame.position,
        frame.end_position,
        frame.producer_id,
        frame.timestamp_us,
    )
