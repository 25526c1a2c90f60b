"""The producer's options: the sending policy and the keyword options of every producer.

:class:`~headgate.client.Producer`'s signature holds the defaults; the
clients that wrap one (:class:`~headgate.client.SyncProducer`) take the same
keywords through :class:`ProducerOptions` and hand them on, so the options
are declared once and their defaults cannot drift apart; :func:`check_options`
refuses the values no producer can work with.
"""

from __future__ import annotations

import os
import secrets
from typing import Literal, TypedDict

from headgate.client.security import ClientSecurity
from headgate.protocol import messages as m

__all__ = ["Policy", "ProducerOptions", "check_options"]

#: ``"wait"`` sends only within guarantees; ``"optimistic"`` sends at once and
#: lets the session resend what the gateway drops.
Policy = Literal["wait", "optimistic", "window"]


class ProducerOptions(TypedDict, total=False):
    """The keyword options of :class:`~headgate.client.Producer`, for the clients that wrap one.

    :class:`~headgate.client.SyncProducer` takes them as ``**options`` and
    hands them on, so their defaults live in one place, ``Producer``'s
    signature (a test checks that the keys match it).
    """

    producer_id: int | None
    producer_secret: bytes | None
    policy: Policy
    linger_ms: float
    max_batch_bytes: int
    max_buffered_bytes: int
    client_name: str
    reconnect_timeout: float | None
    security: ClientSecurity | None
    spool: str | os.PathLike[str] | None
    spool_max_bytes: int
    cluster: str | os.PathLike[str] | None


def check_options(
    *,
    producer_id: int | None,
    producer_secret: bytes | None,
    policy: str,
    linger_ms: float,
    max_batch_bytes: int,
    max_buffered_bytes: int,
    reconnect_timeout: float | None,
) -> tuple[int, bytes]:
    """Refuse options no producer can work with; the producer id and secret to start from.

    The id is random when none is given; the secret is empty until a gateway
    issues one.

    Raises:
        ValueError, TypeError: the first option that cannot work, named.
    """
    if policy not in ("wait", "optimistic", "window"):
        raise ValueError(f"policy must be 'wait', 'optimistic' or 'window', not {policy!r}")
    if producer_id is None:
        producer_id = secrets.randbits(63)
    if not 0 <= producer_id < m.PRODUCER_ID_LIMIT:
        # Spark reads producer ids as a signed 64-bit long.
        raise ValueError(f"producer_id must be in [0, 2**63), got {producer_id}")
    if producer_secret is not None:
        if not isinstance(producer_secret, bytes | bytearray):
            raise TypeError("producer_secret must be bytes (from an earlier producer)")
        if not 1 <= len(producer_secret) <= m.MAX_SECRET_BYTES:
            raise ValueError(f"producer_secret must be 1 to {m.MAX_SECRET_BYTES} bytes")
    if linger_ms < 0:
        raise ValueError(f"linger_ms must not be negative, got {linger_ms}")
    if max_batch_bytes < 64:
        raise ValueError(f"max_batch_bytes is too small: {max_batch_bytes}")
    if max_buffered_bytes < 1:
        raise ValueError(f"max_buffered_bytes must be positive, got {max_buffered_bytes}")
    if reconnect_timeout is not None and reconnect_timeout < 0:
        raise ValueError(f"reconnect_timeout must not be negative, got {reconnect_timeout}")
    return producer_id, b"" if producer_secret is None else bytes(producer_secret)
