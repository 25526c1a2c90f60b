"""A coalescing server channel keeps the same books as one that buffers every message.

The gateway's channels under the credit policy keep consecutive batches of
a handle as one buffer entry (``ServerChannel.coalesce``) and process them a
run at a time, telling the channel the run's size. Whatever the sizes and
however the messages are grouped when processed, every book (capacity,
buffered bytes and messages, issuable, the client's guarantees) must equal
that of a channel that processes the same messages one by one; a size that
disagrees with the buffer is refused and changes nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headgate.protocol.channel import MessageBuffered, ServerChannel

CHANNEL = 5
HANDLE = 3

#: One step: receive a message of a size, or process the oldest ``k``
#: (reissuing or not), or grow and issue.
Step = tuple[str, int, bool]
steps = st.lists(
    st.one_of(
        st.tuples(st.just("receive"), st.integers(0, 300), st.just(False)),
        st.tuples(st.just("process"), st.integers(1, 6), st.booleans()),
        st.tuples(st.just("grow"), st.integers(0, 2000), st.just(False)),
    ),
    max_size=200,
)


def books(channel: ServerChannel[int]) -> tuple[int, int, int, int, int]:
    return (
        channel.capacity,
        channel.buffered_bytes,
        channel.buffered_messages,
        channel.issuable,
        channel.client_guarantees,
    )


@settings(max_examples=300, deadline=None)
@given(steps)
def test_runs_keep_the_books_of_single_messages(script: list[Step]) -> None:
    runs: ServerChannel[int] = ServerChannel(CHANNEL)
    runs.coalesce()
    single: ServerChannel[int] = ServerChannel(CHANNEL)
    # The sizes the caller knows (the gateway: from each batch), oldest first.
    sizes: list[int] = []
    for action, value, reissue in script:
        if action == "receive":
            if value > single.free:
                continue  # a drop is the same for both; not what this is about
            assert isinstance(runs.receive(HANDLE, value), MessageBuffered)
            assert isinstance(single.receive(HANDLE, value), MessageBuffered)
            sizes.append(value)
        elif action == "process":
            count = min(value, len(sizes))
            if not count:
                continue
            size = sum(sizes[:count])
            del sizes[:count]
            assert runs.process(reissue=reissue, count=count, size=size) == (HANDLE, size)
            for _ in range(count):
                single.process(reissue=reissue)
        else:
            runs.grow(value)
            single.grow(value)
            runs.issue()
            single.issue()
        assert books(runs) == books(single)
        # One entry however many messages: the buffer is a single run.
        assert len(runs._buffer) <= 1
    assert runs.buffered_messages == len(sizes)


def test_a_size_that_disagrees_with_the_buffer_changes_nothing() -> None:
    channel: ServerChannel[int] = ServerChannel(CHANNEL)
    channel.coalesce()
    channel.grow(1000)
    channel.issue()
    for size in (100, 200, 300):
        channel.receive(HANDLE, size)
    before = books(channel)
    with pytest.raises(ValueError):
        channel.process(count=3, size=599)  # all of the run: its size is known
    with pytest.raises(ValueError):
        channel.process(count=2)  # part of a run: its size must be given
    with pytest.raises(ValueError):
        channel.process(count=2, size=601)  # more than the run holds
    with pytest.raises(ValueError):
        channel.process(count=0, size=0)
    with pytest.raises(RuntimeError):
        channel.process(count=4, size=600)  # more messages than buffered
    assert books(channel) == before
    assert channel.process(count=2, size=300) == (HANDLE, 300)
    assert channel.process(count=1) == (HANDLE, 300)
    assert books(channel) == (1000, 0, 0, 600, 400)


def test_different_messages_are_not_processed_as_one() -> None:
    channel: ServerChannel[int] = ServerChannel(CHANNEL)
    channel.coalesce()
    channel.grow(1000)
    channel.receive(1, 10)
    channel.receive(2, 20)
    before = books(channel)
    with pytest.raises(ValueError):
        channel.process(count=2, size=30)
    assert books(channel) == before
    assert channel.process() == (1, 10)
    assert channel.process() == (2, 20)


def test_without_coalescing_each_message_keeps_its_size() -> None:
    channel: ServerChannel[int] = ServerChannel(CHANNEL)
    channel.grow(1000)
    channel.receive(HANDLE, 10)
    channel.receive(HANDLE, 20)
    assert channel.process() == (HANDLE, 10)
    assert channel.process() == (HANDLE, 20)
