"""Every state diagram of the resource-control seed, with its numbers, in order.

Each test builds the diagram's first state through the protocol itself, checks
it, then walks the diagram step by step and checks both sides after each step.
The last two tests are LCMUX's diagrams for LimitSending and LimitReceiving.
"""

from __future__ import annotations

from headgate.protocol.channel import (
    AnnounceIssuance,
    ClientChannel,
    DropReason,
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

    lost, apology = client.on_announce_dropping()
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

    limit = server.limit_receiving(2)
    assert limit == LimitReceiving(channel=CHANNEL, bound=2)
    assert_server(server, capacity=2, buffered=[], issuable=0)
    client.on_limit_receiving(limit.bound)
    assert client.guarantees == 2 == server.client_guarantees

    send(server, client, "two", 2)
    assert_server(server, capacity=2, buffered=[2], issuable=0)
    assert client.guarantees == 0 == server.client_guarantees
    assert client.closed and server.closed
