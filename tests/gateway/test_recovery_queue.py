"""The recovery queue of a starting gateway, without threads or sockets."""

from __future__ import annotations

from headgate.gateway.recovery import StreamRecovery


def test_streams_come_back_in_order_and_a_wanted_one_first() -> None:
    queue = StreamRecovery(["a", "b", "c", "d"])
    assert queue.next_name() == "a"
    queue.want("c")
    queue.want("a")  # in progress already: changes nothing
    assert queue.next_name() == "c"
    assert queue.names() == ["a", "c", "b", "d"] and queue.count == 4
    queue.recovered("c")
    assert not queue.recovering("c") and queue.recovering("a")
    assert [queue.next_name(), queue.next_name(), queue.next_name()] == ["b", "d", None]


def test_a_failed_stream_is_no_longer_recovering_and_says_why() -> None:
    queue = StreamRecovery(["a", "b"])
    for name in (queue.next_name(), queue.next_name()):
        assert name is not None
    error = OSError("damaged")
    queue.failed("b", error)
    queue.recovered("a")
    assert queue.finished and queue.failure("b") is error and queue.failure("a") is None
    assert (queue.done, queue.total) == (1, 2)


def test_a_stopping_gateway_abandons_what_it_has_not_started() -> None:
    queue = StreamRecovery(["a", "b", "c"])
    assert queue.next_name() == "a"
    queue.abandon()
    assert queue.next_name() is None and queue.names() == ["a"]
