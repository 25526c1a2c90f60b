"""The pipeline: parse, dead-letter, exactly-once Parquet, and releases after commit."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from headgate.config import ConfigError
from headgate.log import StreamLog
from headgate.protocol.records import encode_records
from headgate.spark.pipeline import (
    Pipeline,
    error_text,
    load_pipeline_config,
    pipeline_config_from_dict,
)


def write_stream(data_dir: Path, name: str, values: list[bytes], per_batch: int = 10) -> int:
    with StreamLog.open(data_dir / "streams" / name, term_length=64 * 1024) as log:
        for i in range(0, len(values), per_batch):
            chunk = values[i : i + per_batch]
            log.append(
                encode_records(chunk),
                producer_id=1,
                first_sequence=i,
                record_count=len(chunk),
                timestamp_us=1_700_000_000_000_000 + i,
            )
        return log.sync()


def config(tmp_path: Path) -> Any:
    return pipeline_config_from_dict(
        {
            "data_dir": str(tmp_path / "data"),
            "streams": {
                "ticks": {
                    "format": "json",
                    "schema": "symbol STRING, price DOUBLE",
                    "transform": "SELECT symbol, price, sequence FROM ticks WHERE price > 0",
                    "partition_by": ["symbol"],
                    "max_records_per_trigger": 30,
                },
                "raw": {"format": "raw"},
            },
        }
    )


def test_good_rows_reach_parquet_bad_ones_the_dead_letters_and_releases_follow_commits(
    spark: Any, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    ticks = [
        json.dumps({"symbol": "AB" if i % 2 else "CD", "price": float(i + 1)}).encode()
        for i in range(95)
    ]
    ticks[17] = b"{not json"
    ticks[50] = b"\xff\xfe binary"
    end_ticks = write_stream(data, "ticks", ticks)
    end_raw = write_stream(data, "raw", [b"r%d" % i for i in range(40)])
    released: list[tuple[str, int]] = []
    pipeline = Pipeline(spark, config(tmp_path), release=lambda s, p: released.append((s, p)))
    pipeline.start(available_now=True)
    pipeline.await_done(120)
    pipeline.stop()

    good = pq.read_table(data / "parquet" / "ticks").to_pydict()
    assert sorted(good["sequence"]) == [i for i in range(95) if i not in (17, 50)]
    assert set(good["symbol"]) == {"AB", "CD"}, "partition column is read back"
    dead = pq.read_table(data / "parquet" / "_dead_letters" / "ticks").to_pydict()
    assert sorted(dead["sequence"]) == [17, 50]
    assert dead["raw"][dead["sequence"].index(17)] == b"{not json"
    # Each row carries its record's address (10 records a batch here).
    assert sorted(zip(dead["sequence"], dead["index"], strict=True)) == [(17, 7), (50, 0)]
    assert all("not valid json" in e for e in dead["error"])
    raw = pq.read_table(data / "parquet" / "raw").to_pydict()
    assert sorted(raw["value"]) == sorted(b"r%d" % i for i in range(40))
    assert sorted(zip(raw["sequence"], raw["index"], strict=True)) == [
        (i, i % 10) for i in range(40)
    ]
    # maxRecordsPerTrigger=30 made several batches; each commit was released,
    # the last one included.
    tick_releases = [p for s, p in released if s == "ticks"]
    assert len(tick_releases) >= 3 and tick_releases == sorted(tick_releases)
    assert tick_releases[-1] == end_ticks
    assert ("raw", end_raw) in released


def test_a_pipeline_waits_for_a_stream_that_does_not_exist_only_when_told_to(
    spark: Any, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    write_stream(data, "other", [b"x"])

    def pipeline(missing: str) -> Pipeline:
        return Pipeline(
            spark,
            pipeline_config_from_dict(
                {
                    "data_dir": str(data),
                    "missing_streams": missing,
                    "output_dir": str(tmp_path / f"out-{missing}"),
                    "checkpoint_dir": str(tmp_path / f"ck-{missing}"),
                    "streams": {"later": {"trigger_seconds": 0.2}},
                }
            ),
        )

    failing = pipeline("fail")
    failing.start(available_now=True)
    try:
        with pytest.raises(Exception) as refused:
            failing.await_done(120)
    finally:
        failing.stop()
    assert error_text(refused.value).startswith(
        f"headgate: stream 'later' does not exist (data directory {data} has other). "
    )
    waiting = pipeline("wait")
    waiting.start()
    output = tmp_path / "out-wait" / "later"
    try:
        deadline = time.monotonic() + 120
        while waiting.queries["later"].lastProgress is None:  # it runs, reading nothing
            assert waiting.queries["later"].isActive and time.monotonic() < deadline
            time.sleep(0.1)
        write_stream(data, "later", [b"a%d" % i for i in range(25)])  # its producer comes
        while not output.exists() or pq.read_table(output).num_rows < 25:
            assert waiting.queries["later"].isActive and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        waiting.stop()
    assert sorted(pq.read_table(output).to_pydict()["value"]) == sorted(
        b"a%d" % i for i in range(25)
    )


def test_a_replayed_batch_replaces_its_own_files(spark: Any, tmp_path: Path) -> None:
    from headgate.spark.transform import commit_batch

    frame = spark.createDataFrame([(1, "a"), (2, "b")], "n INT, s STRING")
    target = tmp_path / "out"
    commit_batch(frame, target, 7, ())
    commit_batch(frame, target, 7, ())  # the same batch id again, after a crash
    commit_batch(frame, target, 8, ())
    assert sorted(pq.read_table(target).to_pydict()["n"]) == [1, 1, 2, 2]


def test_a_restarted_pipeline_writes_nothing_twice(spark: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_stream(data, "raw", [b"a%d" % i for i in range(30)])
    cfg = pipeline_config_from_dict({"data_dir": str(data), "streams": {"raw": {}}})
    first = Pipeline(spark, cfg)
    first.start(available_now=True)
    first.await_done(120)
    first.stop()
    write_stream(data, "raw", [b"b%d" % i for i in range(30)])  # more arrives meanwhile
    second = Pipeline(spark, cfg)
    second.start(available_now=True)
    second.await_done(120)
    second.stop()
    values = pq.read_table(data / "parquet" / "raw").to_pydict()["value"]
    assert len(values) == len(set(values)) == 60


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("", "at least one"),
        ("[streams.a]\nformat = 'xml'\n", "format must be one of"),
        ("[streams.a]\nformat = 'json'\n", "needs a DDL schema"),
        ("[streams.a]\ntrigger_seconds = -1\n", "positive"),
        ("[streams.a]\nmax_records_per_trigger = 0\n", "positive whole"),
        ("[streams.a]\nsink = 'x'\n", "unknown key"),
        ("bogus = 1\n[streams.a]\n", "unknown key"),
    ],
)
def test_bad_pipeline_files_are_named(tmp_path: Path, body: str, fragment: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=fragment):
        load_pipeline_config(path)
