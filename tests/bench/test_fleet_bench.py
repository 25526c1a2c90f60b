"""bench/fleet.py's pure parts: CPU time from /proc/PID/stat, records per partition.

The benchmark itself is not run here (it takes minutes and the whole machine).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def fleet() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_fleet", BENCH / "fleet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses looks the module up by name while the class bodies run.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_cpu_seconds_read_past_a_command_name_with_spaces_and_parentheses(
    fleet: ModuleType,
) -> None:
    # Fields 14 and 15 (utime 250, stime 70 ticks); the name holds ") (" and spaces.
    fields = ["S", "1", "2", "3", "0", "-1", "4194560", "10", "0", "0", "0", "250", "70"]
    line = "4242 (evil) (name 1 2 3) " + " ".join([*fields, "0", "0", "20", "0", "1"]) + "\n"
    assert fleet.cpu_seconds_of_stat(line, 100) == pytest.approx(3.2)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc")
def test_cpu_seconds_of_this_process_agree_with_os_times(fleet: ModuleType) -> None:
    sum(i * i for i in range(300_000))  # some CPU time of our own
    times = os.times()
    ours = fleet.cpu_seconds(os.getpid())
    # Both count whole clock ticks of the same counters, read a moment apart.
    assert abs(ours - (times.user + times.system)) < 0.05
    assert ours > 0


def test_partition_counts_match_counting_record_by_record(fleet: ModuleType) -> None:
    key_partitions = [fleet.partition_of(fleet.key_of(3, i), 6) for i in range(fleet.KEYS)]
    for sent in (0, 1, fleet.KEYS - 1, fleet.KEYS, 3 * fleet.KEYS + 17):
        by_hand = [0] * 6
        for i in range(sent):
            by_hand[key_partitions[i & fleet.KEY_MASK]] += 1
        assert fleet.partition_counts(key_partitions, sent, 6) == by_hand
    # A bulk call of CHECK_EVERY records starts at key 0, as the count assumes.
    assert fleet.CHECK_EVERY % fleet.KEYS == 0
    # The keys reach every partition, so a warm-up send to each binds them all.
    assert set(key_partitions) == set(range(6))


def test_the_default_records_fit_the_partitions(fleet: ModuleType) -> None:
    assert len(fleet.key_of(99, fleet.KEYS - 1)) == fleet.KEY_BYTES
    assert fleet.records_cap(fleet.PARTITIONS, max(fleet.CASES)) >= 3_000_000
