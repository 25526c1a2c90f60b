"""Every state diagram of the resource-control seed, with its numbers, in order.

Each test builds the diagram's first state through the protocol itself, checks
it, then walks the diagram step by step and checks both sides after each step.
Then come LCMUX's diagrams for LimitSending and LimitReceiving, and last the
rules the seed states in prose beside its diagrams, with each error a peer
that breaks them is told.
"""

from __future__ import annotations

import pytest

from headgate.protocol.channel import (
    AnnounceIssuance,
    ClientChannel,
    ClientChannelStatistics,
    DropReason,
    MessageBuffered,
    MessageDropped,
    ServerChannel,
    ServerChannelStatistics,
)
from headgate.protocol.errors import ErrorCode, FlowControlError
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    IssueGuarantees,
    LimitReceiving,
    LimitSending,
    Plead,
)

CHANNEL = 3


def give(server: ServerChannel[str], client: ClientChannel[str], amount: int) -> None:
    """The server grows by ``amount`` and issues it all to the client."""
    server.grow(amount)
    frame = server.issue(amount)
    assert frame is not None
    assert client.on_issue_guarantees(frame.amount) == []


def send(server: ServerChannel[str], client: ClientChannel[str], message: str, size: int) -> None:
    """The client sends a guaranteed message and the server buffers it."""
    client.send(message, size)
    assert server.receive(message, size) == MessageBuffered(size=size)


def assert_server(
    server: ServerChannel[str],
    *,
    capacity: int,
    buffered: list[int],
    issuable: int,
    dropping: bool = False,
) -> None:
    assert server.capacity == capacity
    assert server.buffered_bytes == sum(buffered)
    assert server.buffered_messages == len(buffered)
    assert server.free == capacity - sum(buffered)
    assert server.issuable == issuable
    assert server.dropping is dropping


def test_sending_a_message_uses_up_guarantees_and_leaves_issuable_unchanged() -> None:
    # Six free slots, four of them guaranteed to the client, two unissued.
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    server.grow(6)
    frame = server.issue(4)
    assert frame == IssueGuarantees(channel=CHANNEL, amount=4)
    client.on_issue_guarantees(frame.amount)
    assert_server(server, capacity=6, buffered=[], issuable=2)
    assert server.client_guarantees == 4
    assert client.guarantees == 4

    sent = client.send("three", 3)
    assert sent.confirmed and sent.optimistic_bytes == 0
    assert client.guarantees == 1
    assert server.receive("three", 3) == MessageBuffered(size=3)
    assert_server(server, capacity=6, buffered=[3], issuable=2)
    assert server.client_guarantees == 1 == client.guarantees


def test_increasing_capacity_from_zero_then_issuing_as_many_guarantees() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    assert_server(server, capacity=0, buffered=[], issuable=0)
    assert client.guarantees == 0

    server.grow(5)
    assert_server(server, capacity=5, buffered=[], issuable=5)
    assert client.guarantees == 0

    frame = server.issue()
    assert frame == IssueGuarantees(channel=CHANNEL, amount=5)
    client.on_issue_guarantees(frame.amount)
    assert_server(server, capacity=5, buffered=[], issuable=0)
    assert client.guarantees == 5 == server.client_guarantees


def test_processing_two_messages_then_issuing_three_aggregated_guarantees() -> None:
    # Two free slots, then messages of 2, 1 and 2 bytes (oldest first).
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 7)
    for name, size in [("first", 2), ("second", 1), ("third", 2)]:
        send(server, client, name, size)
    assert_server(server, capacity=7, buffered=[2, 1, 2], issuable=0)
    assert client.guarantees == 2

    assert server.process() == ("first", 2)
    assert_server(server, capacity=7, buffered=[1, 2], issuable=2)
    assert server.free == 4
    assert client.guarantees == 2

    assert server.process() == ("second", 1)
    assert_server(server, capacity=7, buffered=[2], issuable=3)
    assert client.guarantees == 2

    frame = server.issue()
    assert frame == IssueGuarantees(channel=CHANNEL, amount=3)
    client.on_issue_guarantees(frame.amount)
    assert_server(server, capacity=7, buffered=[2], issuable=0)
    assert client.guarantees == 5 == server.client_guarantees


def test_shrinking_the_buffer_by_processing_without_reissuing() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 6)
    send(server, client, "first", 2)
    send(server, client, "second", 2)
    assert_server(server, capacity=6, buffered=[2, 2], issuable=0)
    assert client.guarantees == 2

    assert server.process(reissue=False) == ("first", 2)
    assert_server(server, capacity=4, buffered=[2], issuable=0)
    assert server.free == 2
    assert client.guarantees == 2 == server.client_guarantees


def test_absolution_on_request_shrinks_an_empty_buffer_from_seven_to_three() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 7)
    assert_server(server, capacity=7, buffered=[], issuable=0)
    assert client.guarantees == 7

    plead = server.plead(3)
    assert plead == Plead(channel=CHANNEL, target=3)
    absolve = client.on_plead(plead.target)
    assert absolve == Absolve(channel=CHANNEL, amount=4)
    assert client.guarantees == 3
    assert_server(server, capacity=7, buffered=[], issuable=0)

    server.on_absolve(absolve.amount)
    assert_server(server, capacity=3, buffered=[], issuable=0)
    assert server.client_guarantees == 3 == client.guarantees


def test_plead_concurrent_with_a_one_byte_message_shrinks_nine_slots_to_seven() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 9)
    send(server, client, "two", 2)
    assert_server(server, capacity=9, buffered=[2], issuable=0)
    assert client.guarantees == 7

    # Both at once: the Plead and the one-byte message cross on the wire.
    plead = server.plead(4)
    client.send("one", 1)
    assert client.guarantees == 6

    assert server.receive("one", 1) == MessageBuffered(size=1)
    assert_server(server, capacity=9, buffered=[2, 1], issuable=0)

    absolve = client.on_plead(plead.target)
    assert absolve == Absolve(channel=CHANNEL, amount=2)
    assert client.guarantees == 4

    server.on_absolve(absolve.amount)
    assert_server(server, capacity=7, buffered=[2, 1], issuable=0)
    assert server.free == 4
    assert server.client_guarantees == 4 == client.guarantees


def test_a_plead_that_arrives_below_target_is_ignored() -> None:
    # The text beside the absolution diagrams: "If the client already has
    # fewer guarantees by the time the request for absolution arrives, the
    # client simply ignores the request."
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    client.on_issue_guarantees(2)
    assert client.on_plead(3) is None
    assert client.guarantees == 2


def test_optimistic_message_that_fits_is_buffered_without_special_action() -> None:
    # One free slot, then a 2-byte and a 4-byte message (the 4-byte one is
    # older); one issuable guarantee, and the client holds none.
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 6)
    server.grow(1)
    send(server, client, "four", 4)
    send(server, client, "two", 2)
    assert_server(server, capacity=7, buffered=[4, 2], issuable=1)
    assert client.guarantees == 0

    assert server.process() == ("four", 4)
    assert_server(server, capacity=7, buffered=[2], issuable=5)
    assert server.free == 5
    assert client.guarantees == 0

    sent = client.send("three", 3, optimistic=True)
    assert sent.optimistic_bytes == 3 and not sent.confirmed
    assert client.guarantees == -3
    assert client.in_doubt == ["three"]

    assert server.receive("three", 3) == MessageBuffered(size=3)
    # Issuable stays at five although only two slots are free.
    assert_server(server, capacity=7, buffered=[2, 3], issuable=5)
    assert server.free == 2
    assert server.client_guarantees == -3

    frame = server.issue()
    assert frame == IssueGuarantees(channel=CHANNEL, amount=5)
    assert client.on_issue_guarantees(frame.amount) == ["three"]
    assert_server(server, capacity=7, buffered=[2, 3], issuable=0)
    assert client.guarantees == 2 == server.client_guarantees
    assert client.in_doubt == []


def test_optimistic_sending_gone_awry_drops_until_the_apology() -> None:
    # One free slot beside a 6-byte message; nothing issuable; client holds 1.
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 7)
    send(server, client, "six", 6)
    assert_server(server, capacity=7, buffered=[6], issuable=0)
    assert client.guarantees == 1

    client.send("three", 3, optimistic=True)
    assert client.guarantees == -2
    dropped = server.receive("three", 3)
    # Nothing buffered was optimistic, so only the announcement goes out, in
    # the same step as the drop.
    assert dropped == MessageDropped(
        size=3, reason=DropReason.NO_SPACE, frames=(AnnounceDropping(channel=CHANNEL),)
    )
    assert_server(server, capacity=7, buffered=[6], issuable=0, dropping=True)

    # The one-byte message was on its way before the announcement arrived.
    client.send("one", 1, optimistic=True)
    assert client.guarantees == -3
    assert server.receive("one", 1) == MessageDropped(size=1, reason=DropReason.DROPPING, frames=())
    assert_server(server, capacity=7, buffered=[6], issuable=0, dropping=True)

    lost, apology = client.on_announce_dropping()
    assert lost == ["three", "one"]
    assert client.guarantees == 1
    assert apology == Apologise(channel=CHANNEL)

    server.on_apologise()
    assert_server(server, capacity=7, buffered=[6], issuable=0, dropping=False)
    assert server.client_guarantees == 1 == client.guarantees


def test_guarantees_for_buffered_optimistic_bytes_precede_the_drop_announcement() -> None:
    # The extra-wide diagram: four free slots beside a 3-byte message, three
    # issuable guarantees, the client holds one. The server issues only the
    # debt (one guarantee) before announcing, as drawn.
    server: ServerChannel[str] = ServerChannel(CHANNEL, announce_issuance=AnnounceIssuance.DEBT)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 4)
    server.grow(3)
    send(server, client, "old", 3)
    assert_server(server, capacity=7, buffered=[3], issuable=3)
    assert client.guarantees == 1

    sent = client.send("two", 2, optimistic=True)
    assert sent.optimistic_bytes == 1
    assert client.guarantees == -1
    assert client.in_doubt == ["two"]
    assert server.receive("two", 2) == MessageBuffered(size=2)
    assert_server(server, capacity=7, buffered=[3, 2], issuable=3)
    assert server.free == 2

    sent = client.send("three", 3, optimistic=True)
    assert sent.optimistic_bytes == 3
    assert client.guarantees == -4
    assert client.in_doubt == ["two", "three"]

    dropped = server.receive("three", 3)
    assert isinstance(dropped, MessageDropped)
    issue, announce = dropped.frames
    assert issue == IssueGuarantees(channel=CHANNEL, amount=1)
    assert announce == AnnounceDropping(channel=CHANNEL)
    assert_server(server, capacity=7, buffered=[3, 2], issuable=2, dropping=True)

    assert client.on_issue_guarantees(issue.amount) == ["two"]
    assert client.guarantees == -3
    assert client.in_doubt == ["three"]

    lost, _ = client.on_announce_dropping()
    assert lost == ["three"]
    assert client.in_doubt == []
    assert client.guarantees == 0

    server.on_apologise()
    assert_server(server, capacity=7, buffered=[3, 2], issuable=2, dropping=False)
    assert server.client_guarantees == 0 == client.guarantees


def test_issuing_all_issuable_before_the_announcement_still_identifies_the_drop() -> None:
    # The same diagram with the realistic server the seed mentions: "a
    # realistic server would have issued all three issuable guarantees".
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 4)
    server.grow(3)
    send(server, client, "old", 3)
    client.send("two", 2, optimistic=True)
    server.receive("two", 2)
    client.send("three", 3, optimistic=True)

    dropped = server.receive("three", 3)
    assert isinstance(dropped, MessageDropped)
    assert dropped.frames[0] == IssueGuarantees(channel=CHANNEL, amount=3)
    assert server.issuable == 0
    assert client.on_issue_guarantees(3) == ["two"]
    assert client.guarantees == -1
    lost, _ = client.on_announce_dropping()
    assert lost == ["three"]
    assert client.guarantees == 2 == server.client_guarantees


def test_client_limits_sending_to_two_bytes_and_the_server_blocks_off_three() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 5)
    assert_server(server, capacity=5, buffered=[], issuable=0)
    assert client.guarantees == 5

    limit = client.limit_sending(2)
    assert limit == LimitSending(channel=CHANNEL, bound=2)
    assert client.guarantees == 2
    server.on_limit_sending(limit.bound)
    assert_server(server, capacity=2, buffered=[], issuable=0)
    assert server.client_guarantees == 2

    send(server, client, "two", 2)
    assert_server(server, capacity=2, buffered=[2], issuable=0)
    assert client.guarantees == 0 == server.client_guarantees
    assert client.closed and server.closed


def test_server_limits_receiving_to_two_bytes_and_blocks_off_three() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 5)
    assert_server(server, capacity=5, buffered=[], issuable=0)
    assert client.guarantees == 5

    # LCMUX's diagram limits at once, revoking three issued guarantees. Had
    # a guaranteed message been in flight, it would be dropped, which the
    # seed forbids ("not allowed to drop messages for which it had
    # previously guaranteed buffer capacity"), and the server cannot know.
    # So headgate refuses that bound, and gets there by a Plead first.
    with pytest.raises(ValueError):
        server.limit_receiving(2)
    assert_server(server, capacity=5, buffered=[], issuable=0)
    absolve = client.on_plead(server.plead(2).target)
    assert absolve is not None
    server.on_absolve(absolve.amount)
    limit = server.limit_receiving(2)
    assert limit == LimitReceiving(channel=CHANNEL, bound=2)
    assert_server(server, capacity=2, buffered=[], issuable=0)
    client.on_limit_receiving(limit.bound)
    assert client.guarantees == 2 == server.client_guarantees

    send(server, client, "two", 2)
    assert_server(server, capacity=2, buffered=[2], issuable=0)
    assert client.guarantees == 0 == server.client_guarantees
    assert client.closed and server.closed


# --- the rules the seed states beside its diagrams, and each error ------------------


def test_a_message_that_almost_fits_is_dropped_whole() -> None:
    # "if it can buffer all but one byte of a message, it must still drop the
    # full message and all subsequent ones until the apology"
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    server.grow(4)
    outcome = server.receive("five", 5)
    assert isinstance(outcome, MessageDropped)
    assert outcome.reason is DropReason.NO_SPACE
    assert outcome.frames[-1] == AnnounceDropping(channel=CHANNEL)
    assert server.buffered_bytes == 0 and server.capacity == 4


def test_the_server_keeps_dropping_even_messages_that_fit_until_the_apology() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    server.grow(4)
    server.receive("five", 5)
    assert server.receive("one", 1) == MessageDropped(size=1, reason=DropReason.DROPPING, frames=())
    server.on_apologise()
    assert server.receive("one", 1) == MessageBuffered(size=1)


def test_an_apology_when_not_dropping_is_unexpected_apology() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    with pytest.raises(FlowControlError) as caught:
        server.on_apologise()
    assert caught.value.code is ErrorCode.UNEXPECTED_APOLOGY
    server.receive("one", 1)
    server.on_apologise()
    with pytest.raises(FlowControlError) as caught:
        server.on_apologise()
    assert caught.value.code is ErrorCode.UNEXPECTED_APOLOGY


def test_absolving_more_than_the_client_holds_is_absolved_too_much() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 3)
    server.grow(5)  # issuable, not the client's
    with pytest.raises(FlowControlError) as caught:
        server.on_absolve(4)
    assert caught.value.code is ErrorCode.ABSOLVED_TOO_MUCH
    server.on_absolve(3)
    assert server.capacity == 5 and server.client_guarantees == 0


def test_issue_zero_is_sent_only_when_asked_for() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    assert server.issue() is None
    assert server.issue(0) == IssueGuarantees(channel=CHANNEL, amount=0)
    server.grow(3)
    assert server.issue(2) == IssueGuarantees(channel=CHANNEL, amount=2)
    with pytest.raises(ValueError):
        server.issue(2)
    assert server.issue() == IssueGuarantees(channel=CHANNEL, amount=1)


def test_processed_space_accumulates_until_issued() -> None:
    # "The server need not communicate this immediately"
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 4)
    send(server, client, "a", 1)
    send(server, client, "b", 2)
    server.process()
    server.process()
    assert server.issuable == 3 and client.guarantees == 1
    with pytest.raises(RuntimeError):
        server.process()


def test_only_unpromised_free_space_can_be_shrunk_without_the_client() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 2)
    server.grow(3)
    with pytest.raises(ValueError):
        server.shrink(4)
    server.shrink(3)
    assert server.capacity == 2 and server.client_guarantees == 2


def test_control_frames_consume_neither_guarantees_nor_buffer_space() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 5)
    server.plead(9)
    assert client.on_plead(9) is None
    server.receive("big", 6)  # starts dropping; the announcement is free
    client.send("big", 6, optimistic=True)
    _, apology = client.on_announce_dropping()
    server.on_apologise()
    assert apology == Apologise(channel=CHANNEL)
    assert server.free == 5 and client.guarantees == 5 == server.client_guarantees


def test_a_message_covered_by_guarantees_is_sent_and_not_queued() -> None:
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    client.on_issue_guarantees(3)
    assert client.can_send(3) and not client.can_send(4)
    with pytest.raises(ValueError):
        client.send("four", 4)
    sent = client.send("three", 3)
    assert sent.confirmed and client.in_doubt == []


def test_every_message_after_one_in_doubt_is_queued_too() -> None:
    # If the first is dropped, the server drops all later ones until the apology.
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    client.on_issue_guarantees(2)
    client.send("opt", 3, optimistic=True)
    client.on_issue_guarantees(5)  # pays the one optimistic byte: dequeued
    assert client.in_doubt == []
    client.send("opt2", 5, optimistic=True)  # 4 covered, 1 optimistic
    assert client.guarantees == -1
    client.on_issue_guarantees(0)
    sent = client.send("empty", 0, optimistic=True)
    assert sent.optimistic_bytes == 0 and not sent.confirmed
    assert client.in_doubt == ["opt2", "empty"]
    assert client.statistics() == ClientChannelStatistics(
        guarantees=-1, queued_messages=2, queued_bytes=5, unconfirmed_bytes=1
    )
    assert client.on_issue_guarantees(1) == ["opt2", "empty"]


def test_limit_sending_may_only_tighten() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    client.limit_sending(4)
    # LCMUX: new bounds only "if they strictly tighten the limit": the same
    # bound again does not.
    for loose in (5, 4):
        with pytest.raises(ValueError):
            client.limit_sending(loose)
    server.on_limit_sending(4)
    for loose in (5, 4):
        with pytest.raises(FlowControlError) as caught:
            server.on_limit_sending(loose)
        assert caught.value.code is ErrorCode.LIMIT_LOOSENED
    assert server.send_bound == 4
    server.on_limit_sending(3)
    assert client.limit_sending(3) == LimitSending(channel=CHANNEL, bound=3)


def test_a_message_beyond_the_clients_own_limit_is_limit_exceeded() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 10)
    server.on_limit_sending(3)
    with pytest.raises(FlowControlError) as caught:
        server.receive("four", 4)
    assert caught.value.code is ErrorCode.LIMIT_EXCEEDED
    client.limit_sending(3)
    with pytest.raises(ValueError):
        client.send("four", 4, optimistic=True)


def test_absolutions_count_against_the_sending_limit() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 10)
    server.on_limit_sending(client.limit_sending(6).bound)
    absolve = client.on_plead(4)
    assert absolve == Absolve(channel=CHANNEL, amount=2)
    assert client.send_bound == 4
    server.on_absolve(absolve.amount)
    assert server.send_bound == 4 and server.capacity == 4


def test_limit_receiving_may_only_tighten_and_drops_beyond_the_bound() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 3)
    server.grow(5)
    client.on_limit_receiving(server.limit_receiving(5).bound)
    for loose in (6, 5):
        with pytest.raises(ValueError):
            server.limit_receiving(loose)
    assert server.issuable == 2  # never more guarantees than the bound allows
    send(server, client, "three", 3)
    assert client.receive_bound == server.receive_bound == 2
    with pytest.raises(ValueError):
        client.send("three", 3, optimistic=True)

    # A message sent before the bound reached the client: beyond it, dropped.
    outcome = server.receive("late", 3)
    assert isinstance(outcome, MessageDropped)
    assert outcome.reason is DropReason.RECEIVE_LIMIT
    # Three bytes counted against the bound since it was sent: where it
    # stands now goes with the announcement (see the crossing test below).
    assert outcome.frames == (
        IssueGuarantees(channel=CHANNEL, amount=2),
        LimitReceiving(channel=CHANNEL, bound=2),
        AnnounceDropping(channel=CHANNEL),
    )
    client.on_limit_receiving(2)
    assert client.receive_bound == 2
    server.on_apologise()
    client.on_issue_guarantees(2)
    send(server, client, "two", 2)
    assert server.closed and client.closed
    assert server.receive("one", 1) == MessageDropped(
        size=1,
        reason=DropReason.RECEIVE_LIMIT,
        frames=(LimitReceiving(channel=CHANNEL, bound=0), AnnounceDropping(channel=CHANNEL)),
    )


def test_sizes_and_bounds_must_not_be_negative() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    for call in (
        lambda: server.grow(-1),
        lambda: server.issue(-1),
        lambda: server.plead(-1),
        lambda: server.receive("x", -1),
        lambda: server.limit_receiving(-1),
        lambda: client.send("x", -1),
        lambda: client.limit_sending(-1),
    ):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError):
        server.on_limit_sending(-1)


def test_statistics_snapshot_the_server_books() -> None:
    server: ServerChannel[str] = ServerChannel(CHANNEL)
    client: ClientChannel[str] = ClientChannel(CHANNEL)
    give(server, client, 5)
    server.grow(2)
    send(server, client, "three", 3)
    assert server.statistics() == ServerChannelStatistics(
        capacity=7,
        buffered_bytes=3,
        buffered_messages=1,
        issuable=2,
        client_guarantees=2,
        dropping=False,
    )
