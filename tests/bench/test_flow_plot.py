"""bench/flow.py's plot, drawn from a Result built by hand (the benchmark itself is not run)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
MiB = 1024 * 1024

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def flow() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_flow", BENCH / "flow.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses looks the module up by name while the class bodies run.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def _redis_like_result(flow: ModuleType, timing: Any) -> Any:
    """The shape the issue describes: B steady at the offered rate, A stalled and
    then catching up at about 200 MiB/s, the receiver's memory growing through
    the stall (a backlog kept in the receiver, as Redis's is)."""
    bucket = flow.BUCKET_S
    n = int(timing.end / bucket) + 1
    steady = timing.rate * bucket
    stall = range(int(timing.stall_at / bucket), int(timing.resume_at / bucket))
    a = [0.0 if i in stall else steady for i in range(n)]
    a[stall.stop] = 200 * MiB * bucket  # the catch-up spike
    b = [steady] * n
    memory = [
        flow.MemorySample(
            seconds=i * 0.05,
            rss=(40 + min(i * 0.05, timing.resume_at) * 8) * MiB,
            anon=30 * MiB,
        )
        for i in range(int(timing.end / 0.05))
    ]
    return flow.Result(
        system="Redis Streams",
        solo_rate=timing.rate,
        stall_rate=timing.rate,
        peak_rss=int(max(s.rss for s in memory)),
        buckets={"A": a, "B": b},
        memory=memory,
    )


def test_plot_writes_three_panels_with_b_and_memory_on_their_own_scales(
    flow: ModuleType, tmp_path: Path
) -> None:
    timing = flow.Timing.default(quick=False)
    result = _redis_like_result(flow, timing)

    path = flow.plot(result, timing, tmp_path)
    assert path == tmp_path / "flow-redis-streams.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 1000

    fig = flow.draw(result, timing)
    try:
        rate_a, rate_b, memory = fig.axes
        assert len(fig.axes) == 3
        # A's panel reaches the spike; B's is scaled to B, so its steady
        # 8 MiB/s is not flattened near zero by A's 200 MiB/s.
        assert rate_a.get_ylim()[1] >= 200
        assert 8 <= rate_b.get_ylim()[1] < 20
        # The memory panel carries the samples, in MiB, over the run's seconds.
        rss_line = memory.get_lines()[0]
        assert list(rss_line.get_xdata()) == [s.seconds for s in result.memory]
        assert list(rss_line.get_ydata()) == [s.rss / MiB for s in result.memory]
        assert memory.get_ylim()[1] >= 40 + 5 * 8
        assert memory.get_xlim() == (0, timing.end)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_plot_without_memory_samples_still_draws_three_panels(
    flow: ModuleType, tmp_path: Path
) -> None:
    timing = flow.Timing.default(quick=True)
    n = int(timing.end / flow.BUCKET_S) + 1
    result = flow.Result(system="HTTP/2 (h2)", buckets={"A": [0.0] * n, "B": [0.0] * n})

    path = flow.plot(result, timing, tmp_path)
    assert path == tmp_path / "flow-http2-h2.png"
    assert path.exists()
    fig = flow.draw(result, timing)
    try:
        assert len(fig.axes) == 3
        assert [t.get_text() for t in fig.axes[2].texts] == ["memory not sampled"]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_sampler_keeps_this_process_memory_over_time(flow: ModuleType) -> None:
    """The memory panel's samples, from a real process (this one): in seconds
    from the run's start, in order, none from before it."""
    t0 = time.monotonic()
    sampler = flow.RssSampler(os.getpid())
    deadline = time.monotonic() + 5.0
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    samples = sampler.over_time(t0)
    assert len(samples) >= 3
    assert all(0 <= s.seconds < 2 for s in samples)
    assert [s.seconds for s in samples] == sorted(s.seconds for s in samples)
    assert all(0 < s.anon <= s.rss <= sampler.peak for s in samples)
    assert sampler.over_time(time.monotonic() + 10) == []
