"""A client and a server on one channel, with frames in flight both ways.

Two FIFO wires (client to server, server to client) hold frames that are
delivered one at a time, in any interleaving: each direction keeps its order,
any frame may wait arbitrarily long. The client sends guaranteed and
optimistic messages, absolves when pleaded with, limits its sending, and on
AnnounceDropping apologises and sends the dropped messages again before any
new one. The server processes (reissuing or shrinking), grows, shrinks,
issues, pleads, and limits its receiving.

Every message travels as ``(number, attempt)``: the number is its place in
the stream, the attempt tells a retransmission apart from the original.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from headgate.protocol.channel import (
    ClientChannel,
    MessageBuffered,
    MessageDropped,
    ServerChannel,
)
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    IssueGuarantees,
    LimitReceiving,
    LimitSending,
    Plead,
    ServerFrame,
)
from headgate.protocol.handles import BindingState, Freed, HandleTable, Referenced, UnboundReference
from headgate.protocol.messages import STREAM_CHANNEL as STREAM_BIND_CHANNEL
from headgate.protocol.messages import FreeHandle, HandleType

CHANNEL = 7
STREAM = HandleType.STREAM
Transmission = tuple[int, int]


@dataclass(frozen=True)
class Message:
    """A channel message on the wire."""

    transmission: Transmission
    size: int


ClientWireItem = Message | Absolve | Apologise | LimitSending


def _tightest(*bounds: int | None) -> int | None:
    present = [bound for bound in bounds if bound is not None]
    return min(present) if present else None


class ChannelPair(RuleBasedStateMachine):
    """A correct client and a correct server, and what really happened.

    Invariants, checked after every step (or event, where noted):

    * The server never drops a message that a guarantee covered, nor one that
      the client already believes buffered.
    * The server never buffers more bytes than its capacity.
    * The client's optimistic debt equals its unconfirmed optimistic bytes.
    * When nothing is in flight, the books balance: the client's guarantees
      equal the server's view of them, which equals free space minus issuable
      guarantees, and the server is not dropping.
    * On AnnounceDropping the client names exactly the messages the server
      dropped (or is about to drop, as they are still on the wire).
    * The server accepts every message exactly once and in order, despite
      drops, apologies and retransmissions; drained at the end, every message
      sent is processed.
    * A correct client never makes the server raise a ProtocolError, nor the
      other way round (any exception fails the test).
    """

    def __init__(self) -> None:
        super().__init__()
        self.server: ServerChannel[Transmission] = ServerChannel(CHANNEL)
        self.client: ClientChannel[Transmission] = ClientChannel(CHANNEL)
        self.to_server: deque[ClientWireItem] = deque()
        self.to_client: deque[ServerFrame] = deque()
        self.sizes: dict[int, int] = {}
        self.attempts: dict[int, int] = {}
        self.guaranteed: set[Transmission] = set()
        self.believed_buffered: set[Transmission] = set()
        self.dropped_by_server: set[Transmission] = set()
        self.claimed_dropped: set[Transmission] = set()
        self.next_to_accept = 0
        self.processed: list[int] = []
        self.limited = False
        self.gave_up = False

    # -- helpers --

    def _client_room(self) -> int | None:
        return _tightest(self.client.send_bound, self.client.receive_bound)

    def _transmit(self, number: int, *, prefer_optimistic: bool = False) -> None:
        size = self.sizes[number]
        optimistic = prefer_optimistic or not self.client.can_send(size)
        transmission = (number, self.attempts[number])
        sent = self.client.send(transmission, size, optimistic=optimistic)
        if not optimistic:
            self.guaranteed.add(transmission)
            assert sent.confirmed
        if sent.confirmed:
            self.believed_buffered.add(transmission)
        self.to_server.append(Message(transmission, size))

    # -- client actions --

    @rule(size=st.integers(0, 8), optimistic=st.booleans())
    def client_sends(self, size: int, optimistic: bool) -> None:
        if self.gave_up:
            return
        room = self._client_room()
        if room is not None and size > room:
            return
        if not optimistic and not self.client.can_send(size):
            return
        number = len(self.sizes)
        self.sizes[number] = size
        self.attempts[number] = 0
        self._transmit(number, prefer_optimistic=optimistic)

    @rule(extra=st.integers(0, 30))
    def client_limits_sending(self, extra: int) -> None:
        # A client that will resend what is in doubt leaves room for it.
        bound = self.client.statistics().queued_bytes + extra
        current = self.client.send_bound
        if current is not None and bound >= current:
            return  # LCMUX: a new bound must strictly tighten
        self.limited = True
        self.to_server.append(self.client.limit_sending(bound))

    # -- server actions --

    @precondition(lambda self: self.server.buffered_messages > 0)
    @rule(reissue=st.booleans())
    def server_processes(self, reissue: bool) -> None:
        (number, _), _ = self.server.process(reissue=reissue)
        self.processed.append(number)

    @rule(amount=st.integers(0, 12))
    def server_grows(self, amount: int) -> None:
        self.server.grow(amount)

    @rule(data=st.data())
    def server_shrinks(self, data: st.DataObject) -> None:
        self.server.shrink(data.draw(st.integers(0, min(self.server.issuable, self.server.free))))

    @rule(data=st.data(), everything=st.booleans())
    def server_issues(self, data: st.DataObject, everything: bool) -> None:
        if everything:
            frame = self.server.issue()
        else:
            frame = self.server.issue(data.draw(st.integers(0, self.server.issuable)))
        if frame is not None:
            self.to_client.append(frame)

    @rule(wanted=st.integers(0, 10))
    def server_pleads(self, wanted: int) -> None:
        self.to_client.append(self.server.plead(wanted))

    @rule(slack=st.integers(0, 10))
    def server_limits_receiving(self, slack: int) -> None:
        # Only limits that revoke no issued guarantee: limit_receiving refuses
        # those, since a message in flight may be a guaranteed one.
        bound = max(0, self.server.client_guarantees) + self.server.issuable + slack
        current = self.server.receive_bound
        if current is not None and bound >= current:
            return  # LCMUX: a new bound must strictly tighten
        self.limited = True
        self.to_client.append(self.server.limit_receiving(bound))

    # -- the wires --

    @precondition(lambda self: bool(self.to_server))
    @rule()
    def deliver_to_server(self) -> None:
        self._deliver_to_server(self.to_server.popleft())

    def _deliver_to_server(self, item: ClientWireItem) -> None:
        if isinstance(item, Message):
            outcome = self.server.receive(item.transmission, item.size)
            number, _ = item.transmission
            if isinstance(outcome, MessageBuffered):
                assert item.transmission not in self.claimed_dropped, "buffered yet reported lost"
                assert number == self.next_to_accept, "accepted out of order or twice"
                self.next_to_accept += 1
            else:
                assert isinstance(outcome, MessageDropped)
                assert item.transmission not in self.guaranteed, "dropped a guaranteed message"
                assert item.transmission not in self.believed_buffered
                self.dropped_by_server.add(item.transmission)
                self.to_client.extend(outcome.frames)
        elif isinstance(item, Absolve):
            self.server.on_absolve(item.amount)
        elif isinstance(item, Apologise):
            self.server.on_apologise()
        else:
            self.server.on_limit_sending(item.bound)

    @precondition(lambda self: bool(self.to_client))
    @rule()
    def deliver_to_client(self) -> None:
        self._deliver_to_client(self.to_client.popleft())

    def _deliver_to_client(self, frame: ServerFrame) -> None:
        if isinstance(frame, IssueGuarantees):
            for transmission in self.client.on_issue_guarantees(frame.amount):
                assert transmission not in self.dropped_by_server, "a dropped message confirmed"
                self.believed_buffered.add(transmission)
        elif isinstance(frame, Plead):
            absolve = self.client.on_plead(frame.target)
            if absolve is not None:
                self.to_server.append(absolve)
        elif isinstance(frame, AnnounceDropping):
            self._on_announce()
        else:
            assert isinstance(frame, LimitReceiving)
            self.client.on_limit_receiving(frame.bound)

    def _on_announce(self) -> None:
        lost, apology = self.client.on_announce_dropping()
        lost_set = set(lost)
        assert len(lost_set) == len(lost)
        on_wire = {item.transmission for item in self.to_server if isinstance(item, Message)}
        unclaimed = self.dropped_by_server - self.claimed_dropped
        assert unclaimed <= lost_set, "a dropped message went unnoticed"
        assert lost_set <= unclaimed | on_wire, "a buffered message reported lost"
        # Those still on the wire must be dropped when they arrive.
        assert all(t in self.dropped_by_server or t in on_wire for t in lost)
        self.claimed_dropped |= lost_set
        self.to_server.append(apology)
        for number, _ in lost:
            room = self._client_room()
            if self.gave_up or (room is not None and self.sizes[number] > room):
                # A limit leaves no room to resend: the channel is closing, and
                # resending anything later would break the order.
                self.gave_up = True
                continue
            self.attempts[number] += 1
            self._transmit(number)

    # -- invariants --

    @invariant()
    def buffer_within_capacity(self) -> None:
        assert 0 <= self.server.buffered_bytes <= self.server.capacity
        assert self.server.issuable >= 0
        assert self.client.unconfirmed_bytes == max(0, -self.client.guarantees)

    @invariant()
    def books_balance_when_nothing_is_in_flight(self) -> None:
        if self.to_server or self.to_client:
            return
        server = self.server
        assert self.client.guarantees == server.client_guarantees
        assert server.client_guarantees == server.free - server.issuable
        assert not server.dropping
        assert self.dropped_by_server == self.claimed_dropped
        stats = server.statistics()
        assert stats.client_guarantees == self.client.guarantees
        assert stats.buffered_bytes == server.buffered_bytes

    def teardown(self) -> None:
        """Drain: deliver, grow, issue and process until every message is through."""
        if self.limited:
            return  # a closed channel never takes the rest
        largest = max(self.sizes.values(), default=0)
        for _ in range(10_000):
            while self.server.buffered_messages:
                self.server_processes(reissue=True)
            if self.server.free < largest:
                self.server.grow(largest)
            frame = self.server.issue()
            if frame is not None:
                self.to_client.append(frame)
            if not (self.to_server or self.to_client):
                break
            if self.to_server:
                self._deliver_to_server(self.to_server.popleft())
            if self.to_client:
                self._deliver_to_client(self.to_client.popleft())
        assert not (self.to_server or self.to_client)
        assert self.processed == list(range(len(self.sizes)))
        assert self.client.in_doubt == []
        assert self.client.guarantees == self.server.client_guarantees >= 0


TestChannelPair = ChannelPair.TestCase
TestChannelPair.settings = settings(settings.default, stateful_step_count=60)


# --- data handles -------------------------------------------------------------


@dataclass(frozen=True)
class Bind:
    """A bind message on the creator's bind channel."""

    handle: int
    attempt: int
    value: str
    size: int


@dataclass(frozen=True)
class Reference:
    """A message that references a handle (on some other channel)."""

    handle: int


CreatorWireItem = Bind | Reference | FreeHandle | Apologise
# LimitReceiving never comes: the bind channel here has no receive bound.
KeeperWireItem = IssueGuarantees | LimitReceiving | AnnounceDropping | Reference | FreeHandle


class HandlePeers(RuleBasedStateMachine):
    """A creator of stream handles and the peer that keeps them, over two FIFO wires.

    The creator binds handles over a flow-controlled bind channel, with or
    without guarantees, references handles (optimistically bound ones too),
    and frees confirmed ones. The keeper binds what arrives, references the
    handles it has bound, frees them, and processes buffered references late.
    Dropped binds are announced, apologised for and sent again.

    Invariants:

    * No message ever dereferences a deleted binding, and every dereference
      yields the value the creator bound.
    * Both peers number handles alike: the keeper binds handle ``h`` to the
      creator's value for ``h``.
    * A reference is dropped as unbound only if its bind was really dropped.
    * Each binding counts exactly the buffered messages that reference it.
    * A binding is deleted as soon as it is marked for deletion and nothing
      references it; and once nothing is in flight, every handle that either
      peer proposed to free is marked or deleted on both sides, deleted
      wherever no buffered message references it.
    * Correct peers never raise a ProtocolError.
    """

    def __init__(self) -> None:
        super().__init__()
        self.creator: HandleTable[str] = HandleTable(STREAM, created_by_us=True)
        self.bind_client: ClientChannel[int] = ClientChannel(STREAM_BIND_CHANNEL)
        self.bind_server: ServerChannel[str] = ServerChannel(STREAM_BIND_CHANNEL)
        self.keeper: HandleTable[str] = HandleTable(
            STREAM, created_by_us=False, bind_channel=self.bind_server
        )
        self.to_keeper: deque[CreatorWireItem] = deque()
        self.to_creator: deque[KeeperWireItem] = deque()
        self.creator_buffer: deque[int] = deque()
        self.keeper_buffer: deque[int] = deque()
        self.sizes: dict[int, int] = {}
        self.attempts: dict[int, int] = {}
        self.binds_accepted = 0
        self.binds_dropped: set[int] = set()
        self.proposed_free: set[int] = set()

    @staticmethod
    def value_of(handle: int) -> str:
        return f"stream-{handle}"

    def _send_bind(self, handle: int, *, optimistic: bool) -> None:
        size = self.sizes[handle]
        optimistic = optimistic or not self.bind_client.can_send(size)
        sent = self.bind_client.send(handle, size, optimistic=optimistic)
        if sent.confirmed:
            self.creator.confirm(handle)
        self.attempts[handle] = self.attempts.get(handle, -1) + 1
        self.to_keeper.append(Bind(handle, self.attempts[handle], self.value_of(handle), size))

    # -- creator --

    @rule(size=st.integers(1, 4), optimistic=st.booleans())
    def creator_binds(self, size: int, optimistic: bool) -> None:
        if not optimistic and not self.bind_client.can_send(size):
            return
        handle = self.creator.bind(self.value_of(self.creator.next_handle), confirmed=False)
        self.sizes[handle] = size
        self._send_bind(handle, optimistic=optimistic)

    @rule(data=st.data())
    def creator_references(self, data: st.DataObject) -> None:
        if self.creator.next_handle == 0:
            return
        handle = data.draw(st.integers(0, self.creator.next_handle - 1))
        if self.creator.state(handle) is not BindingState.LIVE:
            with pytest.raises(ValueError):
                self.creator.use(handle)
            return
        assert self.creator.use(handle) == self.value_of(handle)
        self.to_keeper.append(Reference(handle))

    @rule(data=st.data())
    def creator_frees(self, data: st.DataObject) -> None:
        if self.creator.next_handle == 0:
            return
        handle = data.draw(st.integers(0, self.creator.next_handle - 1))
        if self.creator.state(handle) is not BindingState.LIVE:
            return
        if not self.creator.is_confirmed(handle):
            return
        self.proposed_free.add(handle)
        self.to_keeper.append(self.creator.free(handle))

    @precondition(lambda self: bool(self.creator_buffer))
    @rule()
    def creator_processes(self) -> None:
        handle = self.creator_buffer.popleft()
        assert self.creator.dereference(handle) == self.value_of(handle)
        self.creator.release(handle)

    # -- keeper --

    @rule(amount=st.integers(0, 8))
    def keeper_grows(self, amount: int) -> None:
        self.bind_server.grow(amount)

    @rule()
    def keeper_issues(self) -> None:
        frame = self.bind_server.issue()
        if frame is not None:
            self.to_creator.append(frame)

    @rule()
    def keeper_binds_pending(self) -> None:
        for handle in self.keeper.bind_pending():
            assert self.keeper.dereference(handle) == self.value_of(handle)

    @rule(data=st.data())
    def keeper_references(self, data: st.DataObject) -> None:
        if self.keeper.next_handle == 0:
            return
        handle = data.draw(st.integers(0, self.keeper.next_handle - 1))
        if self.keeper.state(handle) is not BindingState.LIVE:
            return
        assert self.keeper.use(handle) == self.value_of(handle)
        self.to_creator.append(Reference(handle))

    @rule(data=st.data())
    def keeper_frees(self, data: st.DataObject) -> None:
        if self.keeper.next_handle == 0:
            return
        handle = data.draw(st.integers(0, self.keeper.next_handle - 1))
        if self.keeper.state(handle) is not BindingState.LIVE:
            return
        self.proposed_free.add(handle)
        self.to_creator.append(self.keeper.free(handle))

    @precondition(lambda self: bool(self.keeper_buffer))
    @rule()
    def keeper_processes(self) -> None:
        handle = self.keeper_buffer.popleft()
        assert self.keeper.dereference(handle) == self.value_of(handle)
        self.keeper.release(handle)

    # -- the wires --

    @precondition(lambda self: bool(self.to_keeper))
    @rule()
    def deliver_to_keeper(self) -> None:
        item = self.to_keeper.popleft()
        if isinstance(item, Bind):
            outcome = self.bind_server.receive(item.value, item.size)
            if isinstance(outcome, MessageBuffered):
                assert item.handle == self.binds_accepted, "binds out of order"
                self.binds_accepted += 1
                self.binds_dropped.discard(item.handle)
            else:
                if item.attempt == self.attempts[item.handle]:
                    assert not self.creator.is_confirmed(item.handle), "confirmed, yet dropped"
                self.binds_dropped.add(item.handle)
                self.to_creator.extend(outcome.frames)
        elif isinstance(item, Reference):
            referenced = self.keeper.on_reference(item.handle)
            if isinstance(referenced, UnboundReference):
                assert item.handle in self.binds_dropped
                assert self.bind_server.dropping
            else:
                assert item.handle not in self.binds_dropped
                assert referenced.value == self.value_of(item.handle)
                self.keeper_buffer.append(item.handle)
        elif isinstance(item, FreeHandle):
            assert item.mine
            freed = self.keeper.on_free(item.handle)
            assert isinstance(freed, Freed), "a confirmed bind was not bound"
            if freed.reply is not None:
                self.to_creator.append(freed.reply)
        else:
            self.bind_server.on_apologise()

    @precondition(lambda self: bool(self.to_creator))
    @rule()
    def deliver_to_creator(self) -> None:
        item = self.to_creator.popleft()
        if isinstance(item, IssueGuarantees):
            for handle in self.bind_client.on_issue_guarantees(item.amount):
                self.creator.confirm(handle)
        elif isinstance(item, AnnounceDropping):
            lost, apology = self.bind_client.on_announce_dropping()
            assert set(lost) >= self.binds_dropped
            self.to_keeper.append(apology)
            for handle in lost:
                self._send_bind(handle, optimistic=False)
        elif isinstance(item, Reference):
            referenced = self.creator.on_reference(item.handle)
            assert isinstance(referenced, Referenced)
            assert referenced.value == self.value_of(item.handle)
            self.creator_buffer.append(item.handle)
        else:
            assert isinstance(item, FreeHandle) and not item.mine
            freed = self.creator.on_free(item.handle)
            assert isinstance(freed, Freed)
            if freed.reply is not None:
                self.to_keeper.append(freed.reply)

    # -- invariants --

    @invariant()
    def bindings_count_their_references_and_die_when_done(self) -> None:
        for table, buffer in (
            (self.creator, self.creator_buffer),
            (self.keeper, self.keeper_buffer),
        ):
            for handle in table:
                assert table.references(handle) == buffer.count(handle)
                if table.state(handle) is BindingState.MARKED:
                    assert table.references(handle) > 0, "marked, unreferenced, not deleted"

    @invariant()
    def frees_complete_when_nothing_is_in_flight(self) -> None:
        if self.to_keeper or self.to_creator:
            return
        for handle in self.proposed_free:
            for table, buffer in (
                (self.creator, self.creator_buffer),
                (self.keeper, self.keeper_buffer),
            ):
                if handle in buffer:
                    assert table.state(handle) is BindingState.MARKED
                else:
                    assert handle not in table, "both freed, unreferenced, still bound"


TestHandlePeers = HandlePeers.TestCase
TestHandlePeers.settings = settings(settings.default, stateful_step_count=60)
