"""The connection lifecycle: every state against every input, and its clocks.

As h11 tests its state machine: the expected table below is written out by
hand from PROTOCOL.md's rules (not read from the code's table), and every
(state, input) pair is tried. Then two cores talk in memory, and time is an
argument everywhere: no test sleeps.
"""

from __future__ import annotations

import pytest

from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder
from headgate.protocol.deadlines import ReceiveDeadlines
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.frames import SendGlobal
from headgate.protocol.lifecycle import (
    PING_GAP_SECONDS,
    PING_STRIKES,
    Answer,
    ConnectionState,
    Input,
    Lifecycle,
    TimerAction,
)
from headgate.protocol.session import (
    KEEPALIVE_NONCE_BASE,
    AckReceived,
    HelloReceived,
    MessageReceived,
    Role,
    Session,
    WelcomeReceived,
)

S = ConnectionState
I = Input  # noqa: E741 (the table reads better short)
A = Answer

HELLO = m.Hello(producer_id=7, client_name="test")


def welcome(idle_timeout_ms: int = 3000) -> m.Welcome:
    return m.Welcome(server_name="gw", max_message_size=1 << 20, idle_timeout_ms=idle_timeout_ms)


# What each state does with each input, from the rules in words:
# - a gateway hears Hello first, a client Welcome (or a refusal in its
#   place); anything else first is BAD_HELLO, and so is a second opener;
# - the peer's Goodbye or unscoped Error ends an open session;
# - our Goodbye closes an open session gently (CLOSING), any other at once;
# - our Error, and a timer that runs out, end the session;
# - after the end, whatever the peer sends is moot.
BAD = "BAD_HELLO"
EXPECTED: dict[S, dict[I, tuple[S, A] | str]] = {
    S.AWAITING_HELLO: {
        I.HELLO: (S.OPEN, A.OPEN),
        I.WELCOME: BAD,
        I.GOODBYE: BAD,
        I.ERROR: BAD,
        I.FREE_HANDLE: BAD,
        I.FRAME: BAD,
        I.SAY_GOODBYE: (S.CLOSED, A.NOTHING),
        I.FAIL: (S.CLOSED, A.NOTHING),
        I.TIMEOUT: (S.CLOSED, A.NOTHING),
    },
    S.AWAITING_WELCOME: {
        I.HELLO: BAD,
        I.WELCOME: (S.OPEN, A.OPEN),
        I.GOODBYE: (S.CLOSED, A.REFUSED),
        I.ERROR: (S.CLOSED, A.REFUSED),
        I.FREE_HANDLE: BAD,
        I.FRAME: BAD,
        I.SAY_GOODBYE: (S.CLOSED, A.NOTHING),
        I.FAIL: (S.CLOSED, A.NOTHING),
        I.TIMEOUT: (S.CLOSED, A.NOTHING),
    },
    S.OPEN: {
        I.HELLO: BAD,
        I.WELCOME: BAD,
        I.GOODBYE: (S.CLOSED, A.END),
        I.ERROR: (S.CLOSED, A.END),
        I.FREE_HANDLE: (S.OPEN, A.HANDLE),
        I.FRAME: (S.OPEN, A.HANDLE),
        I.SAY_GOODBYE: (S.CLOSING, A.NOTHING),
        I.FAIL: (S.CLOSED, A.NOTHING),
        I.TIMEOUT: (S.CLOSED, A.NOTHING),
    },
    S.CLOSING: {
        I.HELLO: BAD,
        I.WELCOME: BAD,
        I.GOODBYE: (S.CLOSED, A.END),
        I.ERROR: (S.CLOSED, A.END),
        # A FreeHandle (or an Ack) that crossed our Goodbye still counts.
        I.FREE_HANDLE: (S.CLOSING, A.HANDLE),
        I.FRAME: (S.CLOSING, A.HANDLE),
        I.SAY_GOODBYE: (S.CLOSING, A.NOTHING),
        I.FAIL: (S.CLOSED, A.NOTHING),
        I.TIMEOUT: (S.CLOSED, A.NOTHING),
    },
    S.CLOSED: {
        I.HELLO: (S.CLOSED, A.MOOT),
        I.WELCOME: (S.CLOSED, A.MOOT),
        I.GOODBYE: (S.CLOSED, A.MOOT),
        I.ERROR: (S.CLOSED, A.MOOT),
        I.FREE_HANDLE: (S.CLOSED, A.MOOT),
        I.FRAME: (S.CLOSED, A.MOOT),
        I.SAY_GOODBYE: (S.CLOSED, A.NOTHING),
        I.FAIL: (S.CLOSED, A.NOTHING),
        I.TIMEOUT: (S.CLOSED, A.NOTHING),
    },
}


def lifecycle_in(state: S) -> Lifecycle:
    """A lifecycle brought to ``state`` by inputs alone (no shortcut into its fields)."""
    if state is S.AWAITING_WELCOME:
        return Lifecycle(I.WELCOME, now=0.0)
    life = Lifecycle(I.HELLO, now=0.0)
    if state is S.AWAITING_HELLO:
        return life
    life.receive(I.HELLO)
    if state is S.CLOSING:
        life.receive(I.SAY_GOODBYE)
    elif state is S.CLOSED:
        life.receive(I.GOODBYE)
    assert life.state is state
    return life


def test_the_expected_table_covers_every_state_and_input() -> None:
    assert set(EXPECTED) == set(S)
    for state, row in EXPECTED.items():
        assert set(row) == set(I), state


@pytest.mark.parametrize("state", list(S), ids=lambda s: s.name)
@pytest.mark.parametrize("input_", list(I), ids=lambda i: i.name)
def test_every_state_against_every_input(state: S, input_: I) -> None:
    life = lifecycle_in(state)
    expected = EXPECTED[state][input_]
    if expected == BAD:
        with pytest.raises(ProtocolError) as caught:
            life.receive(input_, name="Thing")
        assert caught.value.code is ErrorCode.BAD_HELLO
        assert "Thing" in str(caught.value)
        assert life.state is state  # a refused input changes nothing
        return
    assert isinstance(expected, tuple)
    answer = life.receive(input_)
    assert (life.state, answer) == expected
    # Once opened, a session stays "opened" whatever ends it.
    assert life.opened == (answer is A.OPEN or state in (S.OPEN, S.CLOSING, S.CLOSED))
    # Our Goodbye or our Error is the last frame we send (CLOSING: we said
    # Goodbye); the peer's ending, or a timer's, leaves us what we owe.
    assert life.said_last == (input_ in (I.SAY_GOODBYE, I.FAIL) or state is S.CLOSING)


# -- two cores in memory --------------------------------------------------------


class Wire:
    """A client session and a gateway session; bytes move only when told, with a time."""

    def __init__(self, *, now: float = 0.0, handshake_timeout: float = 0.0) -> None:
        self.client = Session(Role.PRODUCER, now=now)
        self.gateway = Session(Role.GATEWAY, now=now, handshake_timeout=handshake_timeout)

    def up(self, now: float) -> list[object]:
        data = self.client.data_to_send()
        if data:
            self.client.lifecycle.sent(now)
        return list(self.gateway.receive_data(data, now))

    def down(self, now: float) -> list[object]:
        data = self.gateway.data_to_send()
        if data:
            self.gateway.lifecycle.sent(now)
        return list(self.client.receive_data(data, now))

    def open(self, now: float, idle_timeout_ms: int = 3000) -> None:
        self.client.send_global(HELLO)
        assert self.up(now) == [HelloReceived(hello=HELLO)]
        self.gateway.send_global(welcome(idle_timeout_ms))
        assert self.down(now) == [WelcomeReceived(welcome=welcome(idle_timeout_ms))]


def state_of(session: Session) -> S:
    return session.lifecycle.state


def globals_in(data: bytes) -> list[m.GlobalMessage]:
    frames = FrameDecoder(max_payload=1 << 20).feed(data)
    return [m.decode_global(f.payload) for f in frames if isinstance(f, SendGlobal)]


def test_both_cores_open_and_say_goodbye_through_closing_to_closed() -> None:
    wire = Wire()
    assert state_of(wire.client) is S.AWAITING_WELCOME
    assert state_of(wire.gateway) is S.AWAITING_HELLO
    wire.open(now=0.0)
    assert state_of(wire.client) is S.OPEN
    assert state_of(wire.gateway) is S.OPEN
    # The client says Goodbye while an Ack is on its way to it: the Ack,
    # which crossed the Goodbye, still counts.
    wire.client.send_global(m.Goodbye(code=ErrorCode.NONE))
    assert state_of(wire.client) is S.CLOSING
    ack = m.Ack(handle=0, next_sequence=3, durable_position=64)
    wire.gateway.send_global(ack)
    assert wire.down(0.1) == [AckReceived(ack=ack)]
    assert not wire.client.closed
    [goodbye] = wire.up(0.2)
    assert isinstance(goodbye, MessageReceived)
    assert state_of(wire.gateway) is S.CLOSED
    assert wire.gateway.closed
    # The gateway's own Goodbye ends the client's session too.
    wire.gateway.send_global(m.Goodbye(code=ErrorCode.NONE))
    [its_goodbye] = wire.down(0.3)
    assert isinstance(its_goodbye, MessageReceived)
    assert state_of(wire.client) is S.CLOSED
    assert wire.client.closed


def test_a_goodbye_before_the_session_opened_ends_it_at_once() -> None:
    client = Session(Role.PRODUCER, now=0.0)
    client.send_global(HELLO)
    client.send_global(m.Goodbye(code=ErrorCode.NONE))
    assert client.lifecycle.state is S.CLOSED
    assert client.closed
    assert client.get_timer() is None


def test_a_refusal_in_place_of_welcome_closes_the_client_for_sending_too() -> None:
    wire = Wire()
    wire.client.send_global(HELLO)
    wire.up(0.0)
    told = wire.gateway.fail(ProtocolError("who are you", code=ErrorCode.UNAUTHENTICATED))
    assert state_of(wire.gateway) is S.CLOSED
    [refusal] = wire.client.receive_data(told, 0.1)
    assert isinstance(refusal, MessageReceived)
    assert state_of(wire.client) is S.CLOSED
    with pytest.raises(RuntimeError):
        wire.client.send_global(m.Ping(nonce=1))


def test_our_ending_error_is_the_last_frame_even_for_a_ping_decoded_before_it() -> None:
    """A release client sends Release, then a Ping as its probe. The gateway
    decodes both before it acts on the Release; it refuses it, ending the
    session: the Ping behind it is not answered, and nothing follows the Error."""
    wire = Wire()
    wire.open(now=0.0)
    wire.client.send_global(m.Release(stream="nowhere", position=0))
    wire.client.send_global(m.Ping(nonce=6))
    [release] = wire.up(0.1)
    assert isinstance(release, MessageReceived)
    told = wire.gateway.fail(
        ProtocolError("no stream called 'nowhere'", code=ErrorCode.UNEXPECTED_FRAME)
    )
    assert [type(g) for g in globals_in(told)] == [m.Error]
    assert wire.gateway.data_to_send() == b""
    with pytest.raises(RuntimeError):
        wire.gateway.send_global(m.Ack(handle=0, next_sequence=1, durable_position=64))


def test_a_ping_is_answered_after_what_came_before_it_was_acted_on() -> None:
    """Hello and a Ping in one read: the Pong follows the Welcome the adapter
    sends for the Hello, never precedes it; a request and a Ping: the Pong
    follows the answer."""
    wire = Wire()
    wire.client.send_global(HELLO)
    wire.client.send_global(m.Ping(nonce=5))
    assert wire.up(0.0) == [HelloReceived(hello=HELLO)]
    wire.gateway.send_global(welcome())
    assert [type(g) for g in globals_in(wire.gateway.data_to_send())] == [m.Welcome, m.Pong]
    wire.client.send_global(m.Metadata(request_id=1))
    wire.client.send_global(m.Ping(nonce=6))
    [request] = wire.up(0.1)
    assert isinstance(request, MessageReceived)
    wire.gateway.send_global(m.ClusterMetadata(request_id=1, gateway="gw", gateways=(), streams=()))
    assert [type(g) for g in globals_in(wire.gateway.data_to_send())] == [
        m.ClusterMetadata,
        m.Pong,
    ]


def test_after_our_goodbye_nothing_more_goes_out_but_what_we_owe_the_peer_s_does() -> None:
    wire = Wire()
    wire.open(now=0.0)
    # The peer's Goodbye after a Ping: the Pong is owed for a frame before it.
    wire.client.send_global(m.Ping(nonce=7))
    wire.client.send_global(m.Goodbye(code=ErrorCode.NONE))
    wire.up(0.1)
    assert state_of(wire.gateway) is S.CLOSED
    assert [type(g) for g in globals_in(wire.gateway.data_to_send())] == [m.Pong]
    # Our Goodbye: a Ping that crosses it is not answered, nor anything else sent.
    wire = Wire()
    wire.open(now=0.0)
    wire.gateway.send_global(m.Goodbye(code=ErrorCode.SHUTTING_DOWN, text="bye"))
    wire.client.send_global(m.Ping(nonce=8))
    assert wire.up(0.1) == []
    wire.gateway.send_global(m.Pong(nonce=9))
    assert [type(g) for g in globals_in(wire.gateway.data_to_send())] == [m.Goodbye]


# -- the clocks ------------------------------------------------------------------


def test_the_gateway_refuses_a_peer_with_no_hello_within_the_handshake_timeout() -> None:
    gateway = Session(Role.GATEWAY, now=100.0, handshake_timeout=5.0)
    assert gateway.get_timer() == 105.0
    assert gateway.handle_timer(104.99) is None
    assert not gateway.closed
    error = gateway.handle_timer(105.0)
    assert error is not None
    assert error.code is ErrorCode.TIMEOUT
    assert error.args[0] == "no Hello in time"
    assert gateway.closed
    assert gateway.get_timer() is None
    # The adapter tells the peer: the Error carries TIMEOUT.
    [told] = globals_in(gateway.fail(error))
    assert isinstance(told, m.Error) and told.code is ErrorCode.TIMEOUT


def test_a_hello_in_time_stops_the_handshake_clock() -> None:
    wire = Wire(now=0.0, handshake_timeout=5.0)
    wire.client.send_global(HELLO)
    wire.up(4.0)
    assert wire.gateway.get_timer() is None
    assert wire.gateway.handle_timer(50.0) is None
    assert not wire.gateway.closed


def test_the_gateway_idle_rule_is_its_receive_deadlines_once_open() -> None:
    deadlines = ReceiveDeadlines(idle_timeout=10.0, frame_timeout=0.0, now=0.0)
    gateway = Session(Role.GATEWAY, now=0.0, handshake_timeout=5.0, deadlines=deadlines)
    client = Session(Role.PRODUCER, now=0.0)
    client.send_global(HELLO)
    gateway.receive_data(client.data_to_send(), 1.0)
    deadlines.decoded(1.0, frames=gateway.frames_received, partial=False)
    # Past the handshake timeout, but open: only the idle rule applies now.
    assert gateway.handle_timer(6.0) is None
    assert gateway.handle_timer(10.9) is None
    error = gateway.handle_timer(11.0)
    assert error is not None and error.code is ErrorCode.TIMEOUT
    assert "no complete frame" in str(error)
    assert gateway.lifecycle.state is S.CLOSED


def test_before_hello_the_idle_timeout_does_not_apply_only_the_handshake() -> None:
    deadlines = ReceiveDeadlines(idle_timeout=1.0, frame_timeout=0.0, now=0.0)
    gateway = Session(Role.GATEWAY, now=0.0, handshake_timeout=5.0, deadlines=deadlines)
    assert gateway.handle_timer(3.0) is None
    error = gateway.handle_timer(5.0)
    assert error is not None and error.args[0] == "no Hello in time"


def test_a_client_pings_at_a_third_of_the_idle_timeout_and_hears_the_pong() -> None:
    wire = Wire()
    wire.open(now=0.0, idle_timeout_ms=3000)  # a Ping every second
    client = wire.client
    assert client.get_timer() == 1.0
    assert client.handle_timer(0.99) is None
    assert client.data_to_send() == b""
    assert client.handle_timer(1.0) is None
    [ping] = globals_in(client.data_to_send())
    assert isinstance(ping, m.Ping) and ping.nonce > KEEPALIVE_NONCE_BASE
    client.lifecycle.sent(1.0)
    # The gateway answers; the Pong is the client's sign of life.
    wire.gateway.send_global(m.Pong(nonce=ping.nonce))
    wire.down(1.05)
    assert client.get_timer() == 2.0
    # Busy both ways: no Ping is needed.
    client.lifecycle.sent(1.9)
    client.receive_data(b"", 1.9)
    assert client.get_timer() == 2.9


def test_a_client_pings_once_an_interval_while_the_gateway_is_silent_then_closes() -> None:
    wire = Wire()
    wire.open(now=0.0, idle_timeout_ms=3000)
    client = wire.client
    pings = 0
    now = 0.0
    error = None
    for _ in range(20):  # bounded: at most 20 timer turns
        due = client.get_timer()
        assert due is not None and due > now - 1e-9
        now = due
        error = client.handle_timer(now)
        pings += sum(isinstance(g, m.Ping) for g in globals_in(client.data_to_send()))
        if error is not None:
            break
    assert error is not None
    assert error.code is ErrorCode.TIMEOUT
    assert now == 3.0  # no word from the gateway for the whole idle timeout
    assert pings == 2  # at 1 s and at 2 s, not a flood
    assert client.closed
    assert client.get_timer() is None


def test_a_client_says_no_ping_after_its_goodbye_but_still_times_out() -> None:
    wire = Wire()
    wire.open(now=0.0, idle_timeout_ms=3000)
    client = wire.client
    client.send_global(m.Goodbye(code=ErrorCode.NONE))
    client.data_to_send()
    assert client.get_timer() == 3.0
    assert client.handle_timer(2.5) is None
    assert client.data_to_send() == b""
    error = client.handle_timer(3.0)
    assert error is not None and error.code is ErrorCode.TIMEOUT


def test_a_gateway_without_an_idle_timeout_needs_no_client_clock() -> None:
    wire = Wire()
    wire.open(now=0.0, idle_timeout_ms=0)
    assert wire.client.get_timer() is None
    assert wire.client.handle_timer(1e9) is None
    assert not wire.client.closed


def test_a_short_idle_timeout_still_spaces_pings_by_the_floor() -> None:
    wire = Wire()
    wire.open(now=0.0, idle_timeout_ms=30)  # a third is 10 ms: floored to 50 ms
    assert wire.client.get_timer() == pytest.approx(0.03)  # idle comes first
    life = Lifecycle(I.WELCOME, now=0.0)
    life.receive(I.WELCOME)
    life.welcomed(150, 0.0)
    assert life.get_timer() == pytest.approx(0.05)
    assert life.handle_timer(0.05) is TimerAction.PING


@pytest.mark.parametrize(
    "message",
    [
        m.Goodbye(code=ErrorCode.SHUTTING_DOWN, text="stopping"),
        m.Error(code=ErrorCode.FORBIDDEN, text="no"),
    ],
    ids=["goodbye", "unscoped-error"],
)
def test_the_session_names_the_message_that_ended_it(message: m.Goodbye | m.Error) -> None:
    """What every client reacts to: one rule says which message ends a session."""
    wire = Wire()
    wire.open(now=0.0)
    assert wire.client.ending is None
    scoped = m.Error(
        code=ErrorCode.FORBIDDEN,
        scope=m.HandleRef(handle_type=m.HandleType.STREAM, handle=0),
        text="not that stream",
    )
    wire.gateway.send_global(scoped)
    wire.down(0.1)
    assert wire.client.ending is None  # about one stream: the session goes on
    wire.gateway.send_global(message)
    wire.gateway.send_global(m.Pong(nonce=1))  # after the end: moot
    assert wire.down(0.2) == [MessageReceived(message=message)]
    assert wire.client.ending == message
    assert state_of(wire.client) is S.CLOSED


def test_a_refusal_in_place_of_welcome_is_the_ending_too() -> None:
    wire = Wire()
    wire.client.send_global(HELLO)
    wire.up(0.0)
    refusal = m.Error(code=ErrorCode.UNAUTHENTICATED, text="who are you")
    wire.gateway.send_global(refusal)
    wire.down(0.1)
    assert wire.client.ending == refusal
    assert not wire.client.opened


def test_a_session_whose_clocks_stood_still_is_stale_after_half_the_idle_timeout() -> None:
    """A SyncReader runs no timers between calls: past half the idle timeout
    since it last sent, the gateway may have closed it as idle."""
    life = Lifecycle(I.WELCOME, now=0.0)
    assert not life.stale(100.0)  # not open yet: nothing to reuse
    life.receive(I.WELCOME)
    life.welcomed(3000, 0.0)
    life.sent(1.0)
    assert not life.stale(2.49)
    assert life.stale(2.5)
    life.sent(2.6)
    assert not life.stale(3.0)
    life.receive(I.GOODBYE)
    assert not life.stale(100.0)  # ended: its end is what the next call reports
    no_idle = Lifecycle(I.WELCOME, now=0.0)
    no_idle.receive(I.WELCOME)
    no_idle.welcomed(0, 0.0)
    assert not no_idle.stale(1e9)


def _opened_gateway() -> tuple[Session, Session]:
    deadlines = ReceiveDeadlines(idle_timeout=60.0, frame_timeout=0.0, now=0.0)
    gateway = Session(Role.GATEWAY, now=0.0, deadlines=deadlines)
    client = Session(Role.PRODUCER, now=0.0)
    client.send_global(HELLO)
    gateway.receive_data(client.data_to_send(), 0.0)
    return gateway, client


def _gateway_lifecycle() -> Lifecycle:
    """A gateway's lifecycle (one with receive deadlines: the end that counts Ping strikes)."""
    return Lifecycle(
        Input.HELLO,
        now=0.0,
        deadlines=ReceiveDeadlines(idle_timeout=60.0, frame_timeout=0.0, now=0.0),
    )


def test_pings_back_to_back_past_the_strikes_end_the_connection_with_resource_exhausted() -> None:
    lifecycle = _gateway_lifecycle()
    # The first Ping and PING_STRIKES more, each the very next frame, in one read.
    for frame in range(1, PING_STRIKES + 2):
        assert lifecycle.pinged(5.0, frame) is None
    error = lifecycle.pinged(5.0, PING_STRIKES + 2)
    assert error is not None and error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "Pings too often" in str(error) and f"at most {PING_STRIKES + 1}" in str(error)


def test_a_gap_or_any_other_frame_between_pings_starts_the_strikes_again() -> None:
    lifecycle = _gateway_lifecycle()
    now, frame = 1.0, 1
    for i in range(10 * PING_STRIKES):
        if i % PING_STRIKES == PING_STRIKES - 1:
            frame += 2  # one other frame between this Ping and the one before
        elif i % PING_STRIKES == PING_STRIKES // 2:
            now += PING_GAP_SECONDS  # or a gap of the whole limit
            frame += 1
        else:
            frame += 1
        assert lifecycle.pinged(now, frame) is None, f"Ping {i} struck out"


def test_only_the_gateway_counts_ping_strikes() -> None:
    client = Lifecycle(Input.WELCOME, now=0.0)
    assert all(client.pinged(0.0, frame) is None for frame in range(1, 10 * PING_STRIKES))


def test_a_gateway_session_refuses_a_ping_flood_and_answers_none_of_it() -> None:
    gateway, client = _opened_gateway()
    gateway.data_to_send()
    for nonce in range(PING_STRIKES + 2):
        client.send_global(m.Ping(nonce=nonce))
    with pytest.raises(ProtocolError) as raised:
        gateway.receive_data(client.data_to_send(), 1.0)
    assert raised.value.code is ErrorCode.RESOURCE_EXHAUSTED
    told = gateway.fail(raised.value)
    assert [type(g) for g in globals_in(told)] == [m.Error], "the Error is the last frame"


def test_a_probe_ping_after_each_request_and_keepalives_are_never_a_flood() -> None:
    """The release client's shape (a Release, then its probe Ping, at once) and a
    keepalive every third of the idle timeout: thousands, and never refused."""
    gateway, client = _opened_gateway()
    for i in range(2000):
        client.send_global(m.Metadata(request_id=i))
        client.send_global(m.Ping(nonce=i))
        gateway.receive_data(client.data_to_send(), 1.0)
    for i in range(200):
        client.send_global(m.Ping(nonce=10_000 + i))
        gateway.receive_data(client.data_to_send(), 2.0 + i * 20.0)
    assert not gateway.lifecycle.ended
    assert len(globals_in(gateway.data_to_send())) >= 2200, "every Ping was answered"
