"""The producer's options: the sending policy and the keyword options of every producer.

:class:`~headgate.client.Producer`'s signature holds the defaults; the
clients that wrap one (:class:`~headgate.client.SyncProducer`) take the same
keywords through :class:`ProducerOptions` and hand them on, so the options
are declared once and their defaults cannot drift apart.
"""

from __future__ import annotations

import os
from typing import Literal, TypedDict

from headgate.client.security import ClientSecurity

__all__ = ["Policy", "ProducerOptions"]

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
