"""Shared test configuration.

Hypothesis runs a few hundred examples per property in CI (the ``ci``
profile, the default) and many more on demand::

    HEADGATE_HYPOTHESIS_PROFILE=long .venv/bin/pytest tests/protocol
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=False,
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "long",
    max_examples=20_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HEADGATE_HYPOTHESIS_PROFILE", "ci"))
