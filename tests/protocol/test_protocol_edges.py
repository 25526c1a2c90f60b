"""Four edges of the channel rules, each closed where the rule lives (channel.py).

* A LimitReceiving may not fall below the guarantees the client holds: the
  seed's server "is still not allowed to drop messages for which it had
  previously guaranteed buffer capacity", and one may be in flight.
* A LimitReceiving that crosses bytes in flight: the client's estimate of
  the bound converges to the server's, so an optimistic resend is not
  dropped again and again.
* Guarantees stop at what the wire carries: the client's guarantees never
  pass 2**64-1, and a value beyond it is refused before any book changes.
* A new LimitSending or LimitReceiving must strictly tighten (LCMUX).
"""

from __future__ import annotations

import pytest

from headgate.protocol import messages as m
from headgate.protocol.c64 import U64_MAX
from headgate.protocol.channel import (
    ClientChannel,
    DropReason,
    MessageBuffered,
    MessageDropped,
    ServerChannel,
)
from headgate.protocol.codec import encode_frame
from headgate.protocol.errors import ErrorCode, FlowControlError
from headgate.protocol.frames import (
    AnnounceDropping,
    Apologise,
    IssueGuarantees,
    LimitReceiving,
)
from headgate.protocol.session import GuaranteesReceived
from tests.protocol.test_session import Pair, records

CHANNEL = 5


def books(server: ServerChannel[str]) -> tuple[object, ...]:
    return (server.statistics(), server.receive_bound, server.send_bound)


def deliver(client: ClientChannel[str], frames: tuple[object, ...]) -> list[str]:
    """The server's frames reach the client; returns what AnnounceDropping says was dropped."""
    dropped: list[str] = []
    for frame in frames:
        if isinstance(frame, IssueGuarantees):
            client.on_issue_guarantees(frame.amount)
        elif isinstance(frame, LimitReceiving):
            client.on_limit_receiving(frame.bound)
        else:
            assert isinstance(frame, AnnounceDropping)
            lost, apology = client.on_announce_dropping()
            assert apology == Apologise(channel=CHANNEL)
            dropped += lost
    return dropped


# --- a LimitReceiving below the issued guarantees ------------------------------------


def test_limit_receiving_below_the_issued_guarantees_is_refused_and_changes_nothing() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    server.grow(100)
    client.on_issue_guarantees(server.issue(60).amount)  # type: ignore[union-attr]
    client.send("guaranteed", 50)  # in flight: the server cannot tell
    before = books(server)
    with pytest.raises(ValueError, match="guaranteed"):
        server.limit_receiving(40)
    assert books(server) == before
    # At the guarantees it is fine, and the message in flight is buffered.
    assert server.limit_receiving(60) == LimitReceiving(channel=CHANNEL, bound=60)
    assert server.issuable == 0
    assert server.receive("guaranteed", 50) == MessageBuffered(size=50)


# --- a LimitReceiving that crosses bytes in flight -----------------------------------


def test_a_limit_receiving_that_crosses_bytes_in_flight_leaves_no_resend_dropped_twice() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    server.grow(100)
    client.on_issue_guarantees(server.issue().amount)  # type: ignore[union-attr]
    client.send("a", 30)  # crosses the LimitReceiving
    limit = server.limit_receiving(100)
    assert server.receive("a", 30) == MessageBuffered(size=30)
    client.on_limit_receiving(limit.bound)
    # The server counted "a" against its bound; the client, which sent it
    # before the bound arrived, did not: its estimate is 30 too high.
    assert (server.receive_bound, client.receive_bound) == (70, 100)

    client.send("b", 80, optimistic=True)
    outcome = server.receive("b", 80)
    assert isinstance(outcome, MessageDropped) and outcome.reason is DropReason.RECEIVE_LIMIT
    assert deliver(client, outcome.frames) == ["b"]
    server.on_apologise()
    # Converged: the client knows the server takes 70 more bytes, so it does
    # not send "b" again to have it dropped again, round after round.
    assert client.receive_bound == server.receive_bound == 70
    for _ in range(5):
        assert not client.fits_bounds(80)
    # What does fit is accepted.
    client.send("c", 70, optimistic=True)
    assert server.receive("c", 70) == MessageBuffered(size=70)
    assert client.receive_bound == server.receive_bound == 0


def test_a_session_does_not_resend_what_the_receive_bound_leaves_no_room_for() -> None:
    # The producer resends dropped batches by itself; one that the peer's
    # LimitReceiving has no room for waits instead of failing the session.
    pair = Pair(optimistic=True)
    pair.open()
    handle = pair.producer.bind_stream("s")
    assert handle is not None
    pair.flush_up()
    channel = m.data_channel(handle)
    block = records(b"x" * 40)
    cost = pair.producer.batch_cost(len(block))
    pair.producer.send_batch(handle, 0, block, optimistic=True)  # no guarantees: dropped
    pair.flush_up()
    # A bound that leaves no room for the batch arrives before the announcement.
    pair.down = encode_frame(LimitReceiving(channel=channel, bound=cost - 1))
    pair.flush_down()
    assert pair.producer.in_doubt(handle) == 1
    assert pair.producer.outbound(channel).receive_bound == cost - 1


# --- guarantees at the wire's limit --------------------------------------------------


def test_guarantees_stop_at_what_the_wire_carries() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    server.grow(U64_MAX)
    server.grow(U64_MAX)
    total = 0
    for _ in range(3):
        frame = server.issue()
        if frame is None:
            break
        client.on_issue_guarantees(frame.amount)  # never refused
        total += frame.amount
    assert total == U64_MAX == client.guarantees == server.client_guarantees
    assert server.issue() is None
    with pytest.raises(ValueError):
        server.issue(1)
    # Spending some makes room for as much again.
    client.send("m", 10)
    assert server.receive("m", 10) == MessageBuffered(size=10)
    frame = server.issue()
    assert frame == IssueGuarantees(channel=CHANNEL, amount=10)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.grow(U64_MAX + 1),
        lambda s: s.issue(U64_MAX + 1),
        lambda s: s.plead(U64_MAX + 1),
        lambda s: s.limit_receiving(U64_MAX + 1),
    ],
    ids=["grow", "issue", "plead", "limit_receiving"],
)
def test_a_value_beyond_64_bits_is_refused_before_the_books_change(call: object) -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    server.grow(10)
    before = books(server)
    with pytest.raises(ValueError):
        call(server)  # type: ignore[operator]
    assert books(server) == before


def test_session_grant_beyond_64_bits_changes_nothing() -> None:
    pair = Pair()
    pair.open()
    handle = pair.producer.bind_stream("s")
    assert handle is not None
    pair.flush_up()
    channel = m.data_channel(handle)
    before = pair.gateway.inbound(channel).statistics()
    with pytest.raises(ValueError):
        pair.gateway.grant(channel, 2**64)
    assert pair.gateway.inbound(channel).statistics() == before
    assert pair.gateway.data_to_send() == b""
    # The most there is, twice: the producer is given 2**64-1 and accepts it.
    pair.gateway.grant(channel, U64_MAX)
    pair.gateway.grant(channel, U64_MAX)
    events = pair.flush_down()
    assert [e.guarantees for e in events if isinstance(e, GuaranteesReceived)] == [U64_MAX]


# --- bounds strictly tighten ----------------------------------------------------------


def test_a_limit_sending_equal_to_what_is_left_is_limit_loosened() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    server.grow(100)
    server.issue()
    server.on_limit_sending(50)
    assert server.receive("ten", 10) == MessageBuffered(size=10)
    with pytest.raises(FlowControlError) as caught:
        server.on_limit_sending(40)  # what is left: no tighter
    assert caught.value.code is ErrorCode.LIMIT_LOOSENED
    server.on_limit_sending(39)
    assert server.send_bound == 39
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    client.limit_sending(20)
    with pytest.raises(ValueError):
        client.limit_sending(20)
