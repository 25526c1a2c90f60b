"""Gateway configuration: embedded defaults, a TOML file, then flags.

Every setting has a default that works on a laptop, so ``headgate serve`` with
no arguments starts a usable gateway. A TOML file overrides the defaults, and
command-line flags override the file. Errors name the file, the key and what
was expected, because a typo in a config file should never become a traceback.

Example ``headgate.toml``::

    [gateway]
    listen = "127.0.0.1:7878"
    unix_socket = "/tmp/headgate.sock"
    data_dir = "./headgate-data"
    stream_capacity = "64MiB"
    term_length = "16MiB"
    group_commit_interval_ms = 2
    group_commit_mode = "interval"  # or "eager": lower ack latency, more fsyncs
    max_message_size = "1MiB"
    max_connection_debt = 4096
    metrics = "127.0.0.1:9108"
    # Security and limits (see README, "Security"):
    tls_cert = "gateway.crt"        # with tls_key: the listener speaks TLS
    tls_key = "gateway.key"
    tls_client_ca = "clients-ca.pem" # require client certificates signed by it
    auth_file = "tokens.toml"       # require a token in Hello (headgate token)
    idle_timeout_ms = 60000
    frame_timeout_ms = 10000
    plead_deadline_ms = 2000
    handshake_timeout_ms = 10000
    max_write_buffer = "1MiB"
    bind_budget = "16KiB"
    max_stream_credit = 0           # per token and stream (credit policy); 0: no cap
    max_streams = 256
    streams_per_token = 64
    max_producer_ids = 100000
    # Fair shares (see README, "Limits"):
    work_budget_ms = 25             # gateway work per second per token
    max_subscriptions = 64          # per connection
    subscriptions_per_token = 256
    connections_per_token = 256     # default: a quarter of max_connections
    writer_slots = 128              # default: an eighth of max_connections
    handshake_rate = 20             # TLS handshakes per second per address
    max_pending_handshakes = 64
    # A fleet (see README, "A fleet of gateways"): this gateway is `gw1` of
    # the cluster file, and serves only the partitions it assigns to gw1.
    cluster = "cluster.toml"
    cluster_name = "gw1"

    [streams.ticks]
    capacity = "32MiB"       # at least two terms (term_length)
    policy = "window"        # credit (default), window or xonxoff
    window = 8               # window: batches in flight per writer
    # xonxoff: pause the writers' connections at `xoff` unreleased bytes,
    # resume them at `xon` (defaults: 3/4 and 1/4 of the capacity)
    # xoff = "6MiB"
    # xon = "2MiB"
    # Consumers (see README, "Consumers"): a blocking consumer that has not
    # released for idle_release_seconds while it has data to commit is held
    # to (hold: producers wait, one WARNING) or detached (becomes non-blocking).
    idle_release_seconds = 300
    idle_policy = "hold"     # hold (default) or detach
    # Retention after release (see README, "Retention"): released data stays
    # readable (a new consumer at `earliest`, a reset, a replay) up to
    # retain_bytes, and no longer than retain_seconds if set. The log's disk
    # budget is capacity + retain_bytes; producers' credit stays `capacity`.
    retain_bytes = "16MiB"   # default 0: the log frees what is released
    retain_seconds = 3600    # needs retain_bytes; default: no age limit

    [streams.ticks.consumers.archive]
    blocking = true          # its pace throttles the producers (default)
    [streams.ticks.consumers.live]
    blocking = false         # never throttles; may fall behind what the log holds
    on_data_loss = "skip"    # fail (default): an error naming the positions;
                             # skip: read on from the oldest held position

``headgate serve`` re-reads the file on SIGHUP: capacities change at once
(see :meth:`headgate.gateway.Gateway.reconfigure`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from headgate.tomlfile import expect_table, read_toml, refuse_unknown

# Consumer names follow the stream names' rule (protocol.messages.is_valid_name).
_CONSUMER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB|K|M|G)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
}

DEFAULT_PORT = 7878
DEFAULT_METRICS_PORT = 9108
#: When a group commit starts (``GatewayConfig.group_commit_mode``).
GROUP_COMMIT_MODES = ("interval", "eager")

#: The flow-control policies a stream can use (see PROTOCOL.md, "Flow-control policies").
POLICIES = ("credit", "window", "xonxoff")
#: What a read behind the log does for a non-blocking consumer.
DATA_LOSS_OUTCOMES = ("fail", "skip")
#: What becomes of a blocking consumer idle for ``idle_release_seconds``.
IDLE_POLICIES = ("hold", "detach")
#: Default of a stream's ``idle_release_seconds``.
DEFAULT_IDLE_RELEASE_S = 300.0


class ConfigError(ValueError):
    """A setting that cannot be used; the message says which and why."""


def parse_size(value: object, *, what: str) -> int:
    """Read a byte size such as ``4096``, ``"64MiB"`` or ``"1 GB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size such as 64MiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: a size cannot be negative ({value})")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            number, unit = match.groups()
            return int(number) * _UNITS[(unit or "").lower()]
    raise ConfigError(f"{what}: expected a size such as 4096 or 64MiB, got {value!r}")


def format_size(size: int) -> str:
    """``size`` in the largest binary unit that holds it exactly (``"16MiB"``)."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def _two_terms(what: str, capacity: int, term_length: int) -> ConfigError:
    """The error for a capacity below two terms, with both ways to fix it.

    Below two terms, a frame that meets the end of a term could wait forever
    for room that its consumer can never release (LOG.md, "Frames"). The
    largest term that fits twice is the
    largest power of two of at least 4096 within half the capacity.
    """
    fixes = f"raise it to at least {format_size(2 * term_length)}"
    if capacity >= 2 * 4096:
        largest = 1 << ((capacity // 2).bit_length() - 1)
        fixes += f", or lower term_length to {format_size(largest)} or less"
    return ConfigError(
        f"{what} ({format_size(capacity)}) must be at least two terms of term_length "
        f"{format_size(term_length)}: {fixes}"
    )


def parse_address(
    value: str, *, what: str = "listen", default_port: int = DEFAULT_PORT
) -> tuple[str, int]:
    """Split ``host:port`` (``[::1]:7878`` for IPv6); a bare host gets the default port."""
    text = value.strip()
    if not text:
        raise ConfigError(f"{what}: empty address")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not port_text:
        return host or "127.0.0.1", default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{what}: port must be a number from 0 to 65535, got {port_text!r}")
    return host or "127.0.0.1", int(port_text)


def format_address(host: str, port: int) -> str:
    """``host:port`` as :func:`parse_address` reads it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class ConsumerSettings:
    """One named consumer of a stream, as the gateway's TOML declares it."""

    #: Whether the consumer holds the log, and so the producers, back.
    blocking: bool = True
    #: ``fail`` or ``skip``: what a read behind the log does once the
    #: consumer is non-blocking (declared so, or detached).
    on_data_loss: str = "fail"


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """Settings for one stream; unset fields fall back to the gateway's."""

    #: Log capacity (bytes between Spark's release position and the tail).
    capacity: int | None = None
    #: Flow-control policy: ``credit``, ``window`` or ``xonxoff``.
    policy: str | None = None
    #: ``window``: batches in flight per writer.
    window: int | None = None
    #: ``xonxoff``: unreleased bytes at which the writers' connections pause.
    xoff: int | None = None
    #: ``xonxoff``: unreleased bytes at which they resume.
    xon: int | None = None
    #: Named consumers the gateway creates at start (``[streams.S.consumers.C]``).
    consumers: tuple[tuple[str, ConsumerSettings], ...] = ()
    #: A blocking consumer that has not released for this long, while it
    #: has something to release, is idle (None: the default, 300 s).
    idle_release_seconds: float | None = None
    #: ``hold`` or ``detach``: what an idle blocking consumer's stream does.
    idle_policy: str | None = None
    #: Released bytes kept readable (on top of ``capacity``); None: 0.
    retain_bytes: int | None = None
    #: Released data older than this is freed even inside ``retain_bytes``.
    retain_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Retention:
    """How much released data a stream keeps readable (its second disk budget).

    The log holds ``capacity + bytes``: ``capacity`` of unreleased data,
    which producers' credit follows, and up to ``bytes`` of released data
    (younger than ``seconds``, if set) for new consumers and replays.
    """

    #: Released bytes kept, at most; 0: none (the log frees what is released).
    bytes: int = 0
    #: Released data older than this is freed anyway; None: no age limit.
    seconds: float | None = None


@dataclass(frozen=True, slots=True)
class FlowSettings:
    """The resolved flow-control settings of one stream."""

    #: ``credit``, ``window`` or ``xonxoff``.
    policy: str
    #: ``window``: batches in flight per writer.
    window: int
    #: ``xonxoff``: the high watermark (bytes unreleased or held).
    xoff: int
    #: ``xonxoff``: the low watermark.
    xon: int


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything ``headgate serve`` needs; the defaults are the embedded ones."""

    #: TCP address to listen on; port 0 picks a free port.
    listen: tuple[str, int] = ("127.0.0.1", DEFAULT_PORT)
    #: Optional Unix socket path to listen on as well.
    unix_socket: Path | None = None
    #: Where stream logs live (``<data_dir>/streams/<name>/``).
    data_dir: Path = Path("headgate-data")
    #: Default log capacity of a stream, the budget its producers share.
    stream_capacity: int = 64 * 1024**2
    #: Size of one memory-mapped term file (a power of two).
    term_length: int = 16 * 1024**2
    #: How often dirty logs are flushed and fsynced (group commit).
    group_commit_interval_ms: float = 2.0
    #: When a group commit starts: ``"interval"`` (the default), every
    #: ``group_commit_interval_ms``; ``"eager"``, as soon as the commit
    #: before it is done and something waits to be committed, so a batch
    #: waits for at most the rest of the commit under way and its own, and
    #: never for an interval, at the price of more fsyncs per second (see
    #: README, "Latency mode"; the interval then only paces retries of a
    #: failing disk).
    group_commit_mode: str = "interval"
    #: Largest channel message (one batch) the gateway accepts.
    max_message_size: int = 1024**2
    #: Largest number of concurrent connections.
    max_connections: int = 1024
    #: Units of work in flight (batches waiting for the log or for the disk,
    #: tail deliveries) above which a connection stops being read.
    max_connection_debt: int = 4096
    #: Address of the Prometheus metrics endpoint; ``None`` (the default)
    #: serves none.
    metrics: tuple[str, int] | None = None
    #: Default flow-control policy of a stream: credit, window or xonxoff.
    policy: str = "credit"
    #: Default window (batches in flight per writer) of ``window`` streams.
    window: int = 8
    #: Certificate chain (PEM) of the TLS listener; None for plain TCP.
    tls_cert: Path | None = None
    #: Private key (PEM) of ``tls_cert``.
    tls_key: Path | None = None
    #: CA bundle (PEM) that client certificates must chain to; set = mutual TLS.
    tls_client_ca: Path | None = None
    #: Tokens file (see ``headgate.gateway.auth``); None lets every peer do anything.
    auth_file: Path | None = None
    #: How long a peer has to send Hello.
    handshake_timeout_ms: float = 10_000.0
    #: A connection that completes no frame for this long is closed with
    #: TIMEOUT (0: never); bytes that complete no frame are not activity, nor
    #: is a frame dripped over more than 0.5 s at under 64 KiB/s.
    #: Announced in Welcome; producers Ping at a third of it.
    idle_timeout_ms: int = 60_000
    #: A frame whose first bytes arrived must be complete within this long,
    #: plus one second per 64 KiB of its length, or the connection is closed
    #: with TIMEOUT (0: no limit). Time while the gateway itself does not read
    #: the connection does not count.
    frame_timeout_ms: int = 10_000
    #: A writer must absolve what a Plead asks within this long, or its
    #: connection is closed with TIMEOUT and its guarantees return to the
    #: stream (0: never). Announced in Welcome. A writer that answers Pleads
    #: (the producer library does, on receipt) needs a round trip; the
    #: deadline is how long one that does not can starve the others. Time
    #: while the gateway does not read the connection does not count.
    plead_deadline_ms: int = 2_000
    #: Bytes queued for a peer that does not read, beyond which it is cut off.
    max_write_buffer: int = 1024**2
    #: Bind-channel guarantees per connection: the bytes of stream-name
    #: bindings one connection may hold at once.
    bind_budget: int = 16 * 1024
    #: Under the credit policy, the most credit the writers of one token (of
    #: one connection without a tokens file) hold on one stream at a time:
    #: guarantees not yet used, plus batches sent under them and not yet
    #: received. A fair share of a big stream is otherwise hundreds of MiB
    #: that a token can send ahead, and that keep arriving (and taking the
    #: gateway's time) for seconds after it stops. Credit is granted again as
    #: it is used, so it bounds what is in flight, not throughput (a writer
    #: asks for more at most every 50 ms: 32 MiB is 640 MiB/s). 0: no cap.
    max_stream_credit: int = 0
    #: Largest number of streams the gateway opens; a bind of a new stream
    #: beyond it is refused. Each stream reserves two terms on disk as soon
    #: as it exists, and up to its capacity when used: size this so that
    #: ``max_streams * stream_capacity`` fits the disk.
    max_streams: int = 256
    #: How many new streams the peers of one token may create together (a
    #: token's own ``max_streams`` overrides it), so that one token cannot use
    #: up ``max_streams`` for the others. Without a tokens file only
    #: ``max_streams`` applies.
    streams_per_token: int = 64
    #: Producer ids the gateway remembers the owner of (a token's name, or
    #: the hash of a secret from Welcome; see ``headgate.gateway.identity``).
    #: Each new id costs one line and one fsync in ``state/producers.log``;
    #: a bind under a new id beyond this is refused (scoped). Ids are kept
    #: for good, so that nobody can take over another producer's id.
    max_producer_ids: int = 100_000
    #: Milliseconds of the gateway's work per second that the peers of one
    #: token may cause together (the peers of one address before Hello, and
    #: always without a tokens file), in bursts of as much. Every request is
    #: charged (``headgate.gateway.budget.Cost``): frames, Pings, listings,
    #: fetch pages, subscriptions and their deliveries, binds, handshakes;
    #: data batches within guarantees are not. Beyond it the peers are not
    #: read from, and their fetches wait, until the budget refills. It
    #: replaces ``max_control_rate`` (frames per second per connection).
    work_budget_ms: float = 25.0
    #: Live subscriptions one connection may hold.
    max_subscriptions: int = 64
    #: Live subscriptions the peers of one token (or address) may hold together.
    subscriptions_per_token: int = 256
    #: Connections the peers of one token may hold at once (only with a
    #: tokens file); 0: a quarter of ``max_connections``.
    connections_per_token: int = 0
    #: Connection slots kept for writers: connections that have not bound a
    #: stream to write may hold at most ``max_connections - writer_slots``.
    #: Once only these are left, a new connection must bind a stream within
    #: ``handshake_timeout_ms`` or it is closed. 0: an eighth of
    #: ``max_connections`` (at least 1).
    writer_slots: int = 0
    #: TLS handshakes per second that one peer address may start, in bursts
    #: of as many; beyond, a new connection is cut off before its handshake,
    #: after being held unread until the address may start one again (one
    #: by one, at most ``handshake_timeout_ms``, at most
    #: ``max_pending_handshakes`` held at once): a flood refused at once would
    #: retry at once, spending its own CPU on tries.
    handshake_rate: float = 20.0
    #: TLS handshakes in progress at once, over all peers.
    max_pending_handshakes: int = 64
    #: The cluster file of the fleet this gateway belongs to (see
    #: :mod:`headgate.cluster`); None: a gateway on its own.
    cluster: Path | None = None
    #: This gateway's name in ``cluster`` (required with it).
    cluster_name: str | None = None
    #: Per-stream overrides by stream name.
    streams: dict[str, StreamSettings] = field(default_factory=dict)

    @property
    def token_connections(self) -> int:
        """Connections one token may hold: ``connections_per_token`` resolved."""
        if self.connections_per_token:
            return self.connections_per_token
        return max(1, self.max_connections // 4)

    @property
    def writer_slots_kept(self) -> int:
        """Connection slots kept for writers: ``writer_slots`` resolved."""
        if self.writer_slots:
            return min(self.writer_slots, self.max_connections)
        return max(1, self.max_connections // 8)

    def stream_capacity_for(self, name: str) -> int:
        """The capacity of stream ``name``, honouring a per-stream override."""
        override = self.streams.get(name)
        if override is not None and override.capacity is not None:
            return override.capacity
        return self.stream_capacity

    def retention_for(self, name: str) -> Retention:
        """The retention of stream ``name`` (none unless its table sets ``retain_bytes``)."""
        over = self.streams.get(name, StreamSettings())
        return Retention(bytes=over.retain_bytes or 0, seconds=over.retain_seconds)

    def consumers_for(self, name: str) -> dict[str, ConsumerSettings]:
        """The consumers the configuration declares for stream ``name``."""
        return dict(self.streams.get(name, StreamSettings()).consumers)

    def idle_rule_for(self, name: str) -> tuple[float, str]:
        """``(idle_release_seconds, idle_policy)`` of stream ``name``, defaults applied."""
        over = self.streams.get(name, StreamSettings())
        seconds = over.idle_release_seconds
        return (
            DEFAULT_IDLE_RELEASE_S if seconds is None else seconds,
            over.idle_policy or "hold",
        )

    def flow_for(self, name: str) -> FlowSettings:
        """The flow-control settings of stream ``name``, overrides applied."""
        over = self.streams.get(name, StreamSettings())
        capacity = self.stream_capacity_for(name)
        xoff = over.xoff if over.xoff is not None else capacity * 3 // 4
        xon = over.xon if over.xon is not None else min(xoff, capacity // 4)
        return FlowSettings(
            policy=over.policy or self.policy,
            window=over.window if over.window is not None else self.window,
            xoff=xoff,
            xon=xon,
        )

    def validate(self) -> GatewayConfig:
        """Check relations between settings; return self for chaining."""
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.window < 1:
            raise ConfigError(f"window must be at least 1 batch, got {self.window}")
        if (self.cluster is None) != (self.cluster_name is None):
            raise ConfigError(
                "cluster and cluster_name go together: the cluster file, and this "
                "gateway's name in it"
            )
        for name, over in self.streams.items():
            if over.policy is not None and over.policy not in POLICIES:
                raise ConfigError(
                    f"streams.{name}.policy must be one of {', '.join(POLICIES)}, "
                    f"got {over.policy!r}"
                )
            if over.window is not None and over.window < 1:
                raise ConfigError(f"streams.{name}.window must be at least 1, got {over.window}")
            if over.retain_seconds is not None and not over.retain_bytes:
                raise ConfigError(
                    f"streams.{name}.retain_seconds needs retain_bytes: the retained data's "
                    "disk budget (retain_seconds only frees it sooner)"
                )
            if over.capacity is not None and over.capacity < 2 * self.term_length:
                raise _two_terms(f"streams.{name}.capacity", over.capacity, self.term_length)
            flow = self.flow_for(name)
            if not 0 <= flow.xon <= flow.xoff:
                raise ConfigError(
                    f"streams.{name}: xon ({flow.xon}) must not exceed xoff ({flow.xoff})"
                )
        tl = self.term_length
        if tl < 4096 or tl & (tl - 1):
            raise ConfigError(f"term_length must be a power of two >= 4096, got {tl}")
        if self.max_message_size > tl // 2:
            fitting_term = 1 << (2 * self.max_message_size - 1).bit_length()
            raise ConfigError(
                f"max_message_size ({format_size(self.max_message_size)}) must be at most half "
                f"of term_length ({format_size(tl)}): lower it to {format_size(tl // 2)}, or "
                f"raise term_length to {format_size(fitting_term)} or more"
            )
        if self.stream_capacity < 2 * tl:
            raise _two_terms("stream_capacity", self.stream_capacity, tl)
        if self.group_commit_interval_ms <= 0:
            raise ConfigError("group_commit_interval_ms must be positive")
        if self.group_commit_mode not in GROUP_COMMIT_MODES:
            raise ConfigError(
                f"group_commit_mode must be one of {', '.join(GROUP_COMMIT_MODES)}, "
                f"got {self.group_commit_mode!r}"
            )
        if self.max_connections < 1:
            raise ConfigError("max_connections must be at least 1")
        if self.max_connection_debt < 1:
            raise ConfigError("max_connection_debt must be at least 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.handshake_timeout_ms <= 0:
            raise ConfigError("handshake_timeout_ms must be positive")
        if self.idle_timeout_ms < 0:
            raise ConfigError("idle_timeout_ms must not be negative (0 disables it)")
        if self.frame_timeout_ms < 0:
            raise ConfigError("frame_timeout_ms must not be negative (0 disables it)")
        if self.plead_deadline_ms < 0:
            raise ConfigError("plead_deadline_ms must not be negative (0 disables it)")
        if self.max_write_buffer < 64 * 1024:
            raise ConfigError(
                f"max_write_buffer must be at least 64KiB, got {self.max_write_buffer}"
            )
        if not 256 <= self.bind_budget <= 1 << 30:
            raise ConfigError(f"bind_budget must be from 256 bytes to 1GiB, got {self.bind_budget}")
        if self.max_stream_credit and self.max_stream_credit < 2 * self.max_message_size:
            raise ConfigError(
                f"max_stream_credit must be 0 (no cap) or at least two messages "
                f"(2 x max_message_size = {2 * self.max_message_size}), "
                f"got {self.max_stream_credit}"
            )
        if self.max_streams < 1:
            raise ConfigError("max_streams must be at least 1")
        if self.streams_per_token < 0:
            raise ConfigError("streams_per_token must not be negative")
        if self.max_producer_ids < 1:
            raise ConfigError("max_producer_ids must be at least 1")
        if not 0.1 <= self.work_budget_ms <= 1000:
            raise ConfigError(
                "work_budget_ms must be from 0.1 to 1000 (ms per second), "
                f"got {self.work_budget_ms}"
            )
        if self.max_subscriptions < 1 or self.subscriptions_per_token < 1:
            raise ConfigError("max_subscriptions and subscriptions_per_token must be at least 1")
        if self.connections_per_token < 0:
            raise ConfigError("connections_per_token must not be negative (0: the default)")
        if not 0 <= self.writer_slots < self.max_connections:
            raise ConfigError(
                f"writer_slots must be from 0 (the default) to max_connections - 1 "
                f"({self.max_connections - 1}), got {self.writer_slots}"
            )
        if self.handshake_rate <= 0:
            raise ConfigError("handshake_rate must be positive (TLS handshakes per second)")
        if self.max_pending_handshakes < 1:
            raise ConfigError("max_pending_handshakes must be at least 1")
        return self


_GATEWAY_KEYS = {
    "listen",
    "unix_socket",
    "data_dir",
    "stream_capacity",
    "term_length",
    "group_commit_interval_ms",
    "group_commit_mode",
    "max_message_size",
    "max_connections",
    "max_connection_debt",
    "metrics",
    "policy",
    "window",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "auth_file",
    "handshake_timeout_ms",
    "idle_timeout_ms",
    "frame_timeout_ms",
    "plead_deadline_ms",
    "max_write_buffer",
    "bind_budget",
    "max_stream_credit",
    "max_streams",
    "streams_per_token",
    "max_producer_ids",
    "work_budget_ms",
    "max_subscriptions",
    "subscriptions_per_token",
    "connections_per_token",
    "writer_slots",
    "handshake_rate",
    "max_pending_handshakes",
    "cluster",
    "cluster_name",
}
#: Keys that were replaced, with what replaced them.
_REPLACED_KEYS = {
    "max_control_rate": "work_budget_ms (milliseconds of gateway work per second per token, "
    "shared by the token's connections; see README, Limits)",
}
_STREAM_KEYS = {
    "retain_bytes",
    "retain_seconds",
    "capacity",
    "policy",
    "window",
    "xoff",
    "xon",
    "consumers",
    "idle_release_seconds",
    "idle_policy",
}
_CONSUMER_KEYS = {"blocking", "on_data_loss"}


def _policy(value: object, what: str) -> str:
    if not isinstance(value, str) or value not in POLICIES:
        raise ConfigError(f"{what}: expected one of {', '.join(POLICIES)}, got {value!r}")
    return value


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what}: expected a whole number of at least 1, got {value!r}")
    return value


def _gateway_from_table(table: dict[str, Any], where: str) -> dict[str, Any]:
    for key in set(table) & set(_REPLACED_KEYS):
        raise ConfigError(f"{where}.{key} is no longer a setting: use {_REPLACED_KEYS[key]}")
    refuse_unknown(table, _GATEWAY_KEYS, where, ConfigError)
    out: dict[str, Any] = {}
    for key, value in table.items():
        what = f"{where}.{key}"
        if key == "listen":
            if not isinstance(value, str):
                raise ConfigError(f'{what}: expected "host:port", got {value!r}')
            out[key] = parse_address(value, what=what)
        elif key in (
            "unix_socket",
            "data_dir",
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "auth_file",
            "cluster",
        ):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{what}: expected a path, got {value!r}")
            out[key] = Path(value)
        elif key == "cluster_name":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{what}: expected a gateway name, got {value!r}")
            out[key] = value
        elif key in (
            "stream_capacity",
            "term_length",
            "max_message_size",
            "max_write_buffer",
            "bind_budget",
            "max_stream_credit",
        ):
            out[key] = parse_size(value, what=what)
        elif key in ("group_commit_interval_ms", "handshake_timeout_ms", "work_budget_ms"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{what}: expected a number of milliseconds, got {value!r}")
            out[key] = float(value)
        elif key == "handshake_rate":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{what}: expected a number per second, got {value!r}")
            out[key] = float(value)
        elif key == "metrics":
            if not isinstance(value, str):
                raise ConfigError(f'{what}: expected "host:port", got {value!r}')
            out[key] = parse_address(value, what=what, default_port=DEFAULT_METRICS_PORT)
        elif key in (
            "max_connections",
            "max_connection_debt",
            "idle_timeout_ms",
            "frame_timeout_ms",
            "plead_deadline_ms",
            "max_streams",
            "streams_per_token",
            "max_producer_ids",
            "max_subscriptions",
            "subscriptions_per_token",
            "connections_per_token",
            "writer_slots",
            "max_pending_handshakes",
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{what}: expected a whole number, got {value!r}")
            out[key] = value
        elif key == "group_commit_mode":
            if value not in GROUP_COMMIT_MODES:
                raise ConfigError(
                    f"{what}: expected one of {', '.join(GROUP_COMMIT_MODES)}, got {value!r}"
                )
            out[key] = value
        elif key == "policy":
            out[key] = _policy(value, what)
        elif key == "window":
            out[key] = _count(value, what)
    return out


def _stream_from_table(table: dict[str, Any], where: str) -> StreamSettings:
    refuse_unknown(table, _STREAM_KEYS, where, ConfigError)

    def size(key: str) -> int | None:
        value = table.get(key)
        return None if value is None else parse_size(value, what=f"{where}.{key}")

    policy = table.get("policy")
    window = table.get("window")
    idle = table.get("idle_release_seconds")
    if idle is not None and (
        isinstance(idle, bool) or not isinstance(idle, int | float) or idle <= 0
    ):
        raise ConfigError(
            f"{where}.idle_release_seconds: expected a number of seconds above 0, got {idle!r}"
        )
    retain_seconds = table.get("retain_seconds")
    if retain_seconds is not None and (
        isinstance(retain_seconds, bool)
        or not isinstance(retain_seconds, int | float)
        or retain_seconds <= 0
    ):
        raise ConfigError(
            f"{where}.retain_seconds: expected a number of seconds above 0, got {retain_seconds!r}"
        )
    idle_policy = table.get("idle_policy")
    if idle_policy is not None and idle_policy not in IDLE_POLICIES:
        raise ConfigError(
            f"{where}.idle_policy: expected one of {', '.join(IDLE_POLICIES)}, got {idle_policy!r}"
        )
    consumers_raw = expect_table(
        table.get("consumers", {}), f"{where}.consumers", ConfigError, "a table of tables"
    )
    consumers = tuple(
        (name, _consumer_from_table(name, value, f"{where}.consumers.{name}"))
        for name, value in consumers_raw.items()
    )
    return StreamSettings(
        capacity=size("capacity"),
        policy=None if policy is None else _policy(policy, f"{where}.policy"),
        window=None if window is None else _count(window, f"{where}.window"),
        xoff=size("xoff"),
        xon=size("xon"),
        consumers=consumers,
        idle_release_seconds=None if idle is None else float(idle),
        idle_policy=idle_policy,
        retain_bytes=size("retain_bytes"),
        retain_seconds=None if retain_seconds is None else float(retain_seconds),
    )


def _consumer_from_table(name: str, table: object, where: str) -> ConsumerSettings:
    if not _CONSUMER_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: {name!r} is not a valid consumer name (letters, digits, '.', '_', '-')"
        )
    settings = expect_table(table, where, ConfigError)
    refuse_unknown(settings, _CONSUMER_KEYS, where, ConfigError)
    blocking = settings.get("blocking", True)
    if not isinstance(blocking, bool):
        raise ConfigError(f"{where}.blocking: expected true or false, got {blocking!r}")
    on_data_loss = settings.get("on_data_loss", "fail")
    if on_data_loss not in DATA_LOSS_OUTCOMES:
        raise ConfigError(
            f"{where}.on_data_loss: expected one of {', '.join(DATA_LOSS_OUTCOMES)}, "
            f"got {on_data_loss!r}"
        )
    return ConsumerSettings(blocking=blocking, on_data_loss=on_data_loss)


def load_gateway_config(path: Path | None = None, **overrides: Any) -> GatewayConfig:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides``.

    Overrides whose value is ``None`` are ignored, so CLI flags that were not
    given do not mask the file.
    """
    config = GatewayConfig()
    if path is not None:
        raw = read_toml(path, "config", ConfigError)
        refuse_unknown(raw, ("gateway", "streams"), str(path), ConfigError, noun="section")
        gateway = expect_table(raw.get("gateway", {}), f"{path}: [gateway]", ConfigError)
        config = replace(config, **_gateway_from_table(gateway, f"{path}: gateway"))
        streams_raw = expect_table(
            raw.get("streams", {}), f"{path}: [streams]", ConfigError, "a table of tables"
        )
        streams: dict[str, StreamSettings] = {}
        for name, table in streams_raw.items():
            where = f"{path}: streams.{name}"
            streams[name] = _stream_from_table(expect_table(table, where, ConfigError), where)
        config = replace(config, streams=streams)
    stream_policies = overrides.pop("stream_policies", None) or {}
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if stream_policies:
        streams = dict(config.streams)
        for name, policy in stream_policies.items():
            streams[name] = replace(
                streams.get(name, StreamSettings()), policy=_policy(policy, f"policy of {name}")
            )
        config = replace(config, streams=streams)
    try:
        return config.validate()
    except ConfigError as exc:
        if path is None:
            raise
        # The settings came from the file and the flags together: name the file.
        raise ConfigError(f"{path}: {exc}") from None
