"""A FreeHandle that crosses frames about the handle's channel, two sessions in memory.

The seed: the peer that proposes to free a handle "commits to not referring
to that handle in any of its future messages". A Plead from the gateway may
already be on its way when the producer proposes the free; the producer
must not answer it (an Absolve names the handle's channel), and the gateway
must count the FreeHandle as giving up the guarantees that the Plead asked
for. Every order of the four steps (the gateway pleads, the producer frees,
bytes go up, bytes go down) must end with the binding deleted on both sides
and no Error on either.
"""

from __future__ import annotations

from itertools import permutations

import pytest

from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode, FlowControlError, ProtocolError
from headgate.protocol.frames import Absolve, IssueGuarantees, Plead
from headgate.protocol.handles import BindingState
from headgate.protocol.session import (
    BatchReceived,
    Event,
    HandleDeleted,
    MessageReceived,
)
from tests.protocol.test_session import Pair, records

STEPS = ("plead", "free", "up", "down")
BLOCK = records(b"x" * 10)


def frames_in(data: bytes) -> list[object]:
    return list(FrameDecoder(max_payload=1 << 20).feed(data))


def opened_with_a_stream(*, buffered: bool) -> tuple[Pair, int]:
    """A pair whose producer holds guarantees on one stream (and, maybe, a buffered batch)."""
    pair = Pair()
    pair.open()
    handle = pair.producer.bind_stream("s")
    assert handle is not None
    pair.flush_up()
    pair.gateway.grant(m.data_channel(handle), 1000)
    pair.flush_down()
    if buffered:
        assert pair.producer.send_batch(handle, 0, BLOCK)
        assert len([e for e in pair.flush_up() if isinstance(e, BatchReceived)]) == 1
    return pair, handle


def errors(events: list[Event]) -> list[m.Error]:
    return [
        e.message
        for e in events
        if isinstance(e, MessageReceived) and isinstance(e.message, m.Error)
    ]


@pytest.mark.parametrize("buffered", [False, True], ids=["empty", "buffered"])
@pytest.mark.parametrize("order", list(permutations(STEPS)), ids="-".join)
def test_every_order_of_a_plead_and_a_free_ends_freed_on_both_sides(
    order: tuple[str, ...], buffered: bool
) -> None:
    pair, handle = opened_with_a_stream(buffered=buffered)
    channel = m.data_channel(handle)
    up: list[Event] = []
    down: list[Event] = []
    for step in order:
        if step == "plead":
            pair.gateway.plead(channel, 0)
        elif step == "free":
            pair.producer.free_stream(handle)
        elif step == "up":
            up += pair.flush_up()
        else:
            down += pair.flush_down()
    for _ in range(3):  # bounded: a FreeHandle and its answer need two trips
        up += pair.flush_up()
        down += pair.flush_down()
    if buffered:
        # The batch still references the handle: the gateway keeps its channel,
        # but the producer's FreeHandle gave up its guarantees there (so the
        # Plead's deadline cannot close the connection), and nothing more is
        # said about it.
        state = pair.gateway.inbound(channel)
        assert state.client_guarantees <= 0
        assert pair.gateway.streams.theirs.state(handle) is BindingState.MARKED
        pair.gateway.issue(channel)
        pair.gateway.plead(channel, 0)
        assert pair.gateway.data_to_send() == b""
        pair.gateway.process(handle)
    assert errors(up) == [] and errors(down) == []
    assert pair.producer.streams.ours.state(handle) is None
    assert pair.gateway.streams.theirs.state(handle) is None
    assert HandleDeleted(handle_type=m.HandleType.STREAM, handle=handle, ours=True) in down
    with pytest.raises(FlowControlError):
        pair.gateway.inbound(channel)
    assert pair.producer.data_to_send() == b"" and pair.gateway.data_to_send() == b""


def test_a_plead_that_crosses_the_free_gets_no_absolve() -> None:
    pair, handle = opened_with_a_stream(buffered=False)
    channel = m.data_channel(handle)
    pair.gateway.plead(channel, 0)
    pair.gateway.issue(channel, 0)
    pair.producer.free_stream(handle)
    pair.flush_down()  # the Plead and a guarantee arrive after the FreeHandle left
    sent = frames_in(pair.producer.data_to_send())
    assert not any(isinstance(f, Absolve | IssueGuarantees | Plead) for f in sent)
    with pytest.raises(ValueError):
        pair.producer.absolve(handle, 1)


def test_a_frame_about_a_handle_after_the_peers_own_free_is_handle_freed() -> None:
    # The other side of the rule: the peer promised, and broke the promise.
    pair, handle = opened_with_a_stream(buffered=True)
    pair.producer.free_stream(handle)
    pair.up = pair.producer.data_to_send() + encode_frame(
        Absolve(channel=m.data_channel(handle), amount=1)
    )
    with pytest.raises(ProtocolError) as caught:
        pair.flush_up()
    assert caught.value.code is ErrorCode.HANDLE_FREED
