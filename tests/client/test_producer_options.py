"""The producer's option checks: each option no producer can work with is
refused by name, before anything connects, and the id and secret to start
from come out of the same place."""

from __future__ import annotations

from typing import Any

import pytest

from headgate.client import Producer
from headgate.client.producer_options import check_options

GOOD: dict[str, Any] = {
    "producer_id": None,
    "producer_secret": None,
    "policy": "wait",
    "linger_ms": 5.0,
    "max_batch_bytes": 256 * 1024,
    "max_buffered_bytes": 1 << 20,
    "reconnect_timeout": None,
}


@pytest.mark.parametrize(
    ("option", "value", "error", "text"),
    [
        ("policy", "eager", ValueError, "policy must be 'wait', 'optimistic' or 'window'"),
        ("producer_id", 2**63, ValueError, r"producer_id must be in \[0, 2\*\*63\)"),
        ("producer_id", -1, ValueError, "producer_id must be in"),
        ("producer_secret", "text", TypeError, "producer_secret must be bytes"),
        ("producer_secret", b"", ValueError, "producer_secret must be 1 to"),
        ("linger_ms", -1, ValueError, "linger_ms must not be negative"),
        ("max_batch_bytes", 63, ValueError, "max_batch_bytes is too small: 63"),
        ("max_buffered_bytes", 0, ValueError, "max_buffered_bytes must be positive"),
        ("reconnect_timeout", -0.5, ValueError, "reconnect_timeout must not be negative"),
    ],
)
def test_an_option_that_cannot_work_is_refused_by_name(
    option: str, value: object, error: type[Exception], text: str
) -> None:
    options: dict[str, Any] = {option: value}
    with pytest.raises(error, match=text):
        check_options(**{**GOOD, **options})
    with pytest.raises(error, match=text):
        Producer("127.0.0.1:1", **options)  # before anything connects


def test_the_id_and_secret_to_start_from() -> None:
    ids = {check_options(**GOOD)[0] for _ in range(5)}
    assert len(ids) > 1 and all(0 <= i < 2**63 for i in ids), "random, in Spark's long range"
    given = bytearray(b"secret")
    assert check_options(**{**GOOD, "producer_id": 7, "producer_secret": given}) == (7, b"secret")
    assert check_options(**{**GOOD, "producer_id": 0})[1] == b"", "no secret until one is issued"
