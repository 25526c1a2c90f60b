"""Every test in tests/log runs twice: with the C frame writer and with the pure-Python one.

The C writer (headgate.log._frame_writer) is optional; where it is not
built, its half of the runs is skipped. Child processes (crash, disk-full
and corruption writers) follow through HEADGATE_PURE_PYTHON_LOG.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from headgate.log import appender

_BUILT = appender._load_frame_writer()


@pytest.fixture(autouse=True, params=["C", "Python"])
def frame_writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Which frame writer this run uses: ``"C"`` or ``"Python"``."""
    path: str = request.param
    if path == "C":
        if _BUILT is None:
            pytest.skip("the C frame writer is not built (or HEADGATE_PURE_PYTHON_LOG is set)")
        monkeypatch.setattr(appender, "_write_frame", _BUILT)
        monkeypatch.delenv(appender.PURE_PYTHON_ENV, raising=False)
    else:
        monkeypatch.setattr(appender, "_write_frame", None)
        monkeypatch.setenv(appender.PURE_PYTHON_ENV, "1")
    assert appender.frame_writer() == path
    yield path
