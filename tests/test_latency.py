"""Percentiles: nearest rank over a recent window, and Prometheus-style bucket quantiles."""

from __future__ import annotations

import math
from itertools import accumulate

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.latency import (
    LatencyWindow,
    bucket_increase,
    bucket_quantile,
    nearest_rank,
)

durations = st.lists(
    st.floats(min_value=0.0, max_value=10.0, allow_nan=False), min_size=1, max_size=300
)
quantiles = st.floats(min_value=0.01, max_value=1.0)


@given(durations, quantiles)
def test_a_nearest_rank_quantile_is_a_value_that_at_least_q_of_them_are_at_or_below(
    values: list[float], q: float
) -> None:
    ordered = sorted(values)
    answer = nearest_rank(ordered, q)
    assert answer in values
    at_or_below = sum(1 for v in values if v <= answer)
    assert at_or_below >= q * len(values) - 1e-9
    # and it is the smallest such value: fewer than q are strictly below it
    assert sum(1 for v in values if v < answer) < q * len(values) + 1e-9


def test_nearest_rank_on_known_values() -> None:
    hundred = [float(i) for i in range(1, 101)]
    assert nearest_rank(hundred, 0.5) == 50.0
    assert nearest_rank(hundred, 0.99) == 99.0
    assert nearest_rank(hundred, 1.0) == 100.0
    assert nearest_rank([7.0], 0.99) == 7.0
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)
    with pytest.raises(ValueError):
        nearest_rank([1.0], 0.0)


@given(durations)
def test_the_window_summary_is_ordered_and_keeps_only_the_latest(values: list[float]) -> None:
    window = LatencyWindow(size=64, horizon_s=1000.0)
    for i, v in enumerate(values):
        window.observe(v, now=float(i))
    summary = window.summary(now=float(len(values)))
    assert summary is not None
    kept = values[-64:]
    assert summary.count == len(kept)
    assert summary.max == max(kept)
    assert min(kept) <= summary.p50 <= summary.p99 <= summary.max


def test_the_window_forgets_what_is_older_than_its_horizon() -> None:
    window = LatencyWindow(size=100, horizon_s=10.0)
    assert window.summary(now=0.0) is None
    window.observe(5.0, now=0.0)  # a stall long ago
    for i in range(10):
        window.observe(0.001, now=20.0 + i)
    summary = window.summary(now=29.0)
    assert summary is not None
    assert (summary.count, summary.p99, summary.max) == (10, 0.001, 0.001)
    assert window.summary(now=100.0) is None  # quiet since: nothing to show


def test_bucket_quantile_interpolates_within_the_bucket_as_prometheus_does() -> None:
    # 100 observations: 50 in (0, 1 ms], 40 in (1, 5 ms], 10 in (5, 10 ms].
    buckets = [(0.001, 50.0), (0.005, 90.0), (0.01, 100.0), (math.inf, 100.0)]
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.001)
    assert bucket_quantile(buckets, 0.7) == pytest.approx(0.003)  # halfway through (1, 5]
    assert bucket_quantile(buckets, 0.99) == pytest.approx(0.0095)
    assert bucket_quantile(buckets, 0.25) == pytest.approx(0.0005)  # first bucket from 0
    beyond = [(0.001, 1.0), (math.inf, 100.0)]
    assert bucket_quantile(beyond, 0.99) == math.inf
    assert bucket_quantile([], 0.5) is None
    assert bucket_quantile([(0.001, 0.0), (math.inf, 0.0)], 0.5) is None


bounds = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1.0)


@given(st.lists(st.floats(min_value=0.0, max_value=0.999), min_size=1, max_size=200), quantiles)
def test_a_bucket_quantile_lies_in_the_bucket_that_holds_the_exact_quantile(
    values: list[float], q: float
) -> None:
    buckets = [(le, float(sum(1 for v in values if v <= le))) for le in bounds]
    buckets.append((math.inf, float(len(values))))
    answer = bucket_quantile(buckets, q)
    exact = nearest_rank(sorted(values), q)
    assert answer is not None
    upper = next(le for le in bounds if exact <= le)
    lower = max([0.0, *(le for le in bounds if le < upper)])
    assert lower <= answer <= upper + 1e-12


@given(st.lists(st.integers(min_value=0, max_value=50), min_size=4, max_size=4))
def test_the_increase_between_two_scrapes_is_what_was_added(added: list[int]) -> None:
    les = [0.001, 0.01, 0.1, math.inf]
    before = [(0.001, 3.0), (0.01, 5.0), (0.1, 9.0), (math.inf, 10.0)]
    running = 0
    now = []
    for (le, count), more in zip(before, added, strict=True):
        running += more
        now.append((le, count + running))
    increase = bucket_increase(now, before)
    assert [le for le, _ in increase] == les
    assert [c for _, c in increase] == list(accumulate(added))
    assert bucket_increase(now, None) == now
    restarted = [(le, 0.0) for le in les]
    assert bucket_increase(restarted, before) == restarted  # counts began again
