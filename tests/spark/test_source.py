"""The headgate Spark source, over real stream logs.

Logs are written with the real :class:`~headgate.log.StreamLog` in a temporary
data directory, laid out as the gateway lays it out
(``<data dir>/streams/<stream>``). The first group of tests needs no Spark
(options, admission, splitting, decoding); the rest run real queries on the
one shared local session, mostly ``Trigger.AvailableNow`` into a memory or
Parquet sink, and check the result with SQL.
"""

from __future__ import annotations

import json
import pickle
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from headgate.log import StreamLog
from headgate.protocol.records import encode_records
from headgate.spark import SCHEMA, SourceError
from headgate.spark.decode import StreamSlice, arrow_schema, read_slice
from headgate.spark.planning import StreamLogs, StreamSelection, admit, plan_slices
from headgate.spark.source import (
    HeadgatePartition,
    HeadgateStreamReader,
    SourceOptions,
    missing_streams_error,
)

TERM = 4096  # small terms: ranges cross many terms and padding
BASE_TIME_US = 1_700_000_000_000_000

Row = tuple[str, int, int, int, int, int, bytes | None, bytes]


@dataclass
class Stream:
    """What a test wrote to one stream, and what Spark must give back."""

    name: str
    directory: Path
    producer: int
    #: (stream, position, index, producer, sequence, ingest_time_us, key, value), in log order.
    rows: list[Row] = field(default_factory=list)
    #: (position, end_position, record count) of each frame.
    frames: list[tuple[int, int, int]] = field(default_factory=list)
    next_sequence: int = 0

    def append(
        self,
        sizes: list[int],
        *,
        keys: str = "mixed",
        clock: int = 0,
        release: int | None = None,
    ) -> None:
        """Append one frame per size; ``keys`` is "none", "all" or "mixed" (some null)."""
        with StreamLog.open(self.directory, term_length=TERM, capacity=1 << 22) as log:
            for index, size in enumerate(sizes):
                first = self.next_sequence
                values = [f"{self.name}-{first + i}".encode() * (1 + i % 3) for i in range(size)]
                key_list: list[bytes | None] | None
                if keys == "none":
                    key_list = None
                elif keys == "all":
                    key_list = [f"k{first + i}".encode() for i in range(size)]
                else:
                    key_list = [None if i % 3 == 0 else f"k{i}".encode() for i in range(size)]
                stamp = BASE_TIME_US + clock + index * 1000
                result = log.append(
                    encode_records(values, key_list),
                    producer_id=self.producer,
                    first_sequence=first,
                    record_count=size,
                    timestamp_us=stamp,
                )
                self.frames.append((result.position, result.end_position, size))
                for i, value in enumerate(values):
                    key = None if key_list is None else key_list[i]
                    self.rows.append(
                        (
                            self.name,
                            result.position,
                            i,
                            self.producer,
                            first + i,
                            stamp,
                            key,
                            value,
                        )
                    )
                self.next_sequence += size
            log.sync()
            if release is not None:
                log.release(release)
                log.sync()

    @property
    def end(self) -> int:
        return self.frames[-1][1]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


def make_stream(data_dir: Path, name: str, producer: int = 1) -> Stream:
    return Stream(name, data_dir / "streams" / name, producer)


def spark_rows(frame: DataFrame) -> list[Row]:
    """Collected rows as plain tuples, ingest_time as microseconds, in log order."""
    rows = frame.selectExpr(
        "stream",
        "position",
        "index",
        "producer",
        "sequence",
        "unix_micros(ingest_time) AS ingest_us",
        "key",
        "value",
    ).collect()
    out = [
        (
            r.stream,
            r.position,
            r["index"],
            r.producer,
            r.sequence,
            r.ingest_us,
            None if r.key is None else bytes(r.key),
            bytes(r.value),
        )
        for r in rows
    ]
    return sorted(out, key=lambda row: (row[0], row[1], row[2]))


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def options(data_dir: Path, **extra: str) -> dict[str, str]:
    return {"path": str(data_dir), **extra}


# --- without Spark: options ---------------------------------------------------------


def test_options_are_checked_when_the_source_is_created(data_dir: Path) -> None:
    parsed = SourceOptions.parse(
        {
            "path": str(data_dir),
            "STREAMS": "a, b",
            "startingOffsets": '{"b": 8, "a": 0}',
            "maxRecordsPerTrigger": "10",
        }
    )
    assert parsed.selection.names == ("a", "b")
    assert parsed.starting == {"a": 0, "b": 8}
    assert list(parsed.starting) == ["a", "b"]
    assert parsed.max_records == 10 and parsed.max_bytes is None

    def refused(raw: dict[str, str], match: str) -> None:
        with pytest.raises(ValueError, match=match):
            SourceOptions.parse(raw)

    refused({}, "exactly one of option 'path'")
    refused({"path": "x", "gateway": "h:1"}, "exactly one of option 'path'")
    assert SourceOptions.parse({"gateway": " h:1 "}).gateway == "h:1"
    refused({"gateway": "nohost"}, "host:port")
    refused({"gateway": "h:0"}, "host:port")
    refused({"gateway": "h:65536"}, "host:port")
    refused(options(data_dir, streams="a", streamPattern="a.*"), "not both")
    refused(options(data_dir, streamPattern="("), "not a regex")
    refused(options(data_dir, startingOffsets="newest"), "startingOffsets")
    refused(options(data_dir, startingOffsets='{"a": -1}'), "startingOffsets")
    refused(options(data_dir, endingOffsets="earliest"), "endingOffsets")
    # Kafka's options, or a misspelt one, are refused rather than ignored,
    # and the message lists what the source does take.
    refused(options(data_dir, maxOffsetsPerTrigger="10"), "unknown option 'maxOffsetsPerTrigger'")
    refused(options(data_dir, groupIdPrefix="x"), "takes .*startingOffsets")
    refused(
        options(data_dir, includeHeaders="true", stream="a"),
        "unknown options 'includeHeaders', 'stream'",
    )
    refused(options(data_dir, maxRecordsPerTrigger="0"), "must be positive")
    refused(options(data_dir, maxBytesPerTrigger="lots"), "must be an integer")
    assert parsed.missing_streams == "fail"
    assert (
        SourceOptions.parse(options(data_dir, streams="a", missingStreams=" Wait")).missing_streams
        == "wait"
    )
    refused(
        options(data_dir, streams="a", missingStreams="later"), "must be fail or wait, got 'later'"
    )
    refused(options(data_dir, missingStreams="wait"), "'missingStreams' applies to .*'streams'")
    refused(
        options(data_dir, streamPattern="a.*", missingStreams="fail"),
        "'missingStreams' applies to .*'streams'",
    )


def test_a_named_stream_that_does_not_exist_is_refused_unless_told_to_wait(
    data_dir: Path,
) -> None:
    for name in ("a", "b"):
        make_stream(data_dir, name).append([2])
    (data_dir / "streams" / "half-made").mkdir()  # not a log yet: not a stream
    named = options(data_dir, streams="a,nosuch,half-made")
    refused = HeadgateStreamReader(SourceOptions.parse(named))
    try:
        with pytest.raises(SourceError) as error:
            refused.initialOffset()
    finally:
        refused.stop()
    assert str(error.value).startswith(
        "headgate: streams 'nosuch', 'half-made' do not exist "
        f"(data directory {data_dir} has a, b). "
    )
    assert "missingStreams to 'wait'" in str(error.value) and "\n" not in str(error.value)
    # A query that resumes a checkpoint is checked at its first latestOffset;
    # a stream its offset already holds is not "missing" but gone (its own message).
    resumed = HeadgateStreamReader(SourceOptions.parse(options(data_dir, streams="a,gone")))
    try:
        with pytest.raises(SourceError, match=r"stream 'gone' does not exist"):
            resumed.latestOffset({"a": 0}, resumed.getDefaultReadLimit())
        with pytest.raises(SourceError, match=r"stream 'gone': its log directory .* is gone"):
            resumed.latestOffset({"a": 0, "gone": 64}, resumed.getDefaultReadLimit())
    finally:
        resumed.stop()
    waiting = HeadgateStreamReader(SourceOptions.parse({**named, "missingStreams": "wait"}))
    try:
        assert waiting.initialOffset() == {"a": 0}
    finally:
        waiting.stop()


def test_the_missing_stream_message_lists_at_most_twenty_streams() -> None:
    existing = [f"s{i:02d}" for i in range(25)]
    line = missing_streams_error(["x"], existing, "gateway h:1")
    assert "stream 'x' does not exist (gateway h:1 has s00, s01," in line
    assert "s19 and 5 more)" in line and "s20" not in line
    assert "(gateway h:1 has no streams yet)" in missing_streams_error(["x"], [], "gateway h:1")


# --- without Spark: admission, splitting, decoding -------------------------------------


def test_admission_takes_whole_frames_oldest_first_within_the_limits(data_dir: Path) -> None:
    a, b = make_stream(data_dir, "a"), make_stream(data_dir, "b", producer=2)
    a.append([4, 4, 4], clock=0)  # at 0, 1, 2 ms
    b.append([3, 30, 3], clock=500)  # at 0.5, 1.5, 2.5 ms
    logs = StreamLogs(str(data_dir), StreamSelection())
    ranges = {"a": (0, a.end), "b": (0, b.end)}
    try:
        # a0 (4) + b0 (3) = 7; a1 would make 11.
        assert admit(logs, ranges, max_records=10, max_bytes=None) == {
            "a": a.frames[0][1],
            "b": b.frames[0][1],
        }
        # From there, b1 (30 records) is the oldest frame after a1: a1 fits, b1 does not.
        after = {"a": (a.frames[0][1], a.end), "b": (b.frames[0][1], b.end)}
        assert admit(logs, after, max_records=10, max_bytes=None) == {
            "a": a.frames[1][1],
            "b": b.frames[0][1],
        }
        # A frame larger than the limit, when it is the oldest, goes alone.
        alone = {"a": (a.frames[1][1], a.end), "b": (b.frames[0][1], b.end)}
        assert admit(logs, alone, max_records=10, max_bytes=None) == {
            "a": a.frames[1][1],
            "b": b.frames[1][1],
        }
        # Bytes count log bytes (header, payload, alignment): exactly two frames here.
        two_frames = (a.frames[0][1] - a.frames[0][0]) + (b.frames[0][1] - b.frames[0][0])
        assert admit(logs, ranges, max_records=None, max_bytes=two_frames) == {
            "a": a.frames[0][1],
            "b": b.frames[0][1],
        }
    finally:
        logs.close()


def test_partitions_cut_at_frame_boundaries_and_cover_the_range_once(data_dir: Path) -> None:
    a, b = make_stream(data_dir, "a"), make_stream(data_dir, "b")
    a.append([5] * 200, keys="none")  # many terms
    b.append([2] * 3)  # small: shares a partition with a's last piece
    logs = StreamLogs(str(data_dir), StreamSelection())
    ranges = {"a": (0, a.end), "b": (0, b.end)}
    try:
        for target in (2 * TERM, TERM // 2):  # term cuts (no scan), then frame cuts (scan)
            planned = plan_slices(logs, ranges, target)
            assert len(planned) >= 3
            pieces = [piece for partition in planned for piece in partition]
            boundaries = {0} | {end for _, end, _ in a.frames} | {end for _, end, _ in b.frames}
            for piece in pieces:
                assert piece.start in boundaries or piece.start % TERM == 0
            rows = [
                row
                for piece in pieces
                for batch in read_slice(str(data_dir), piece, arrow_schema())
                for row in batch.to_pylist()
            ]
            assert sorted((r["stream"], r["sequence"]) for r in rows) == sorted(
                (s.name, s.rows[i][4]) for s in (a, b) for i in range(len(s.rows))
            )
    finally:
        logs.close()


def test_batches_have_the_declared_schema_and_own_their_memory(data_dir: Path) -> None:
    from pyspark.sql.pandas.types import to_arrow_schema

    a = make_stream(data_dir, "a")
    a.append([3, 0, 7], keys="mixed")
    a.append([2], keys="none")
    # read_slice closes its reader (unmapping the terms) when it is done; the
    # batches must still be whole afterwards.
    batches = list(read_slice(str(data_dir), StreamSlice("a", 0, a.end), arrow_schema()))
    assert batches[0].schema.equals(to_arrow_schema(SCHEMA, timezone="UTC"))
    rows = [tuple(r.values()) for b in batches for r in b.to_pylist()]
    assert [(*r[:5], r[6], r[7]) for r in rows] == [(*r[:5], r[6], r[7]) for r in a.rows]


def test_reader_and_partitions_pickle_without_open_logs(data_dir: Path) -> None:
    a = make_stream(data_dir, "a")
    a.append([1])
    reader = HeadgateStreamReader(SourceOptions.parse(options(data_dir)))
    assert reader.initialOffset() == {"a": 0}  # opens the driver's logs
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.initialOffset() == {"a": 0}
    partition = reader.partitions({"a": 0}, {"a": a.end})[0]
    assert pickle.loads(pickle.dumps(partition)) == partition
    assert isinstance(partition, HeadgatePartition) and partition.gateway is None
    reader.stop()
    clone.stop()


def test_a_directory_that_is_not_yet_a_log_is_not_a_stream(data_dir: Path) -> None:
    a = make_stream(data_dir, "a")
    a.append([1])
    (data_dir / "streams" / "being-created").mkdir()
    logs = StreamLogs(str(data_dir), StreamSelection())
    try:
        assert logs.discover() == ["a"]
    finally:
        logs.close()
    with pytest.raises(SourceError, match=r"data directory .* does not exist"):
        StreamLogs(str(data_dir / "nowhere"), StreamSelection()).discover()


def test_a_released_position_is_named_in_the_error(data_dir: Path) -> None:
    a = make_stream(data_dir, "a")
    a.append([10] * 60)
    a.append([1], release=2 * TERM)
    reader = HeadgateStreamReader(SourceOptions.parse(options(data_dir)))
    try:
        assert reader.initialOffset() == {"a": 2 * TERM}
        with pytest.raises(SourceError, match=r"stream 'a': position 0 was already released"):
            reader.partitions({"a": 0}, {"a": a.end})
        with pytest.raises(SourceError, match=r"stream 'a': position 0 was already released"):
            list(read_slice(str(data_dir), StreamSlice("a", 0, a.end), arrow_schema()))
    finally:
        reader.stop()


def test_a_page_released_while_it_is_decoded_is_refused_not_returned(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Freed terms are recycled (cleared and reused): a page whose range the
    # log freed between the read and the copy out of the map must not count.
    import headgate.spark.decode as decode

    a = make_stream(data_dir, "a")
    a.append([10] * 60)
    decoded = decode.frames_to_batch

    def freed_meanwhile(*args: Any, **kwargs: Any) -> Any:
        batch = decoded(*args, **kwargs)
        with StreamLog.open(data_dir / "streams" / "a", term_length=TERM, capacity=1 << 22) as log:
            log.release(a.frames[30][0])
            log.sync()
        return batch

    monkeypatch.setattr(decode, "frames_to_batch", freed_meanwhile)
    with pytest.raises(SourceError, match=r"stream 'a': positions from 0 were released while"):
        list(read_slice(str(data_dir), StreamSlice("a", 0, a.end), arrow_schema()))


# --- without Spark: consumers, startingTimestamp, failOnDataLoss ----------------------


def test_consumer_starting_timestamp_and_fail_on_data_loss_options_are_checked(
    data_dir: Path,
) -> None:
    parsed = SourceOptions.parse(
        options(data_dir, consumer="archive", failOnDataLoss="FALSE", startingTimestamp="1500")
    )
    assert (parsed.consumer, parsed.fail_on_data_loss) == ("archive", False)
    assert parsed.starting_timestamp_us == 1_500_000
    iso = SourceOptions.parse(options(data_dir, startingTimestamp="2023-11-14T22:13:20Z"))
    assert iso.starting_timestamp_us == 1_700_000_000_000_000
    assert SourceOptions.parse(options(data_dir)).fail_on_data_loss is True
    for bad, match in [
        ({"consumer": "no way"}, "option 'consumer' must be a consumer name"),
        ({"failOnDataLoss": "maybe"}, "'failOnDataLoss' must be true or false"),
        ({"startingTimestamp": "yesterday"}, "'startingTimestamp' must be milliseconds"),
        ({"startingTimestamp": "2023-11-14T22:13:20"}, "with its zone"),
        ({"startingTimestamp": "1", "startingOffsets": "latest"}, "not both"),
    ]:
        with pytest.raises(ValueError, match=match):
            SourceOptions.parse(options(data_dir, **bad))


def test_starting_timestamp_starts_each_stream_at_its_first_frame_at_or_after_it(
    data_dir: Path,
) -> None:
    a = make_stream(data_dir, "a")
    a.append([3] * 10)  # frames stamped BASE_TIME_US + 0, 1000, ..., 9000 µs
    b = make_stream(data_dir, "b")
    b.append([2] * 3)  # all before the time: starts at its end
    millis = (BASE_TIME_US + 4500) // 1000 + 1  # 5000 µs after BASE_TIME_US, rounded up
    assert millis * 1000 == BASE_TIME_US + 5000
    reader = HeadgateStreamReader(
        SourceOptions.parse(options(data_dir, startingTimestamp=str(millis)))
    )
    try:
        assert reader.initialOffset() == {"a": a.frames[5][0], "b": b.end}
    finally:
        reader.stop()


def test_fail_on_data_loss_false_skips_what_the_log_freed_and_reports_it(data_dir: Path) -> None:
    a = make_stream(data_dir, "a")
    a.append([10] * 60)
    a.append([1], release=2 * TERM)
    strict = HeadgateStreamReader(SourceOptions.parse(options(data_dir, consumer="live")))
    try:
        with pytest.raises(
            SourceError,
            match=r"stream 'a': position 0 was already released; the oldest position the log "
            rf"retains is {2 * TERM}: {2 * TERM} bytes were freed before this query "
            r"\(consumer 'live'\) read them. Set option failOnDataLoss to false",
        ):
            strict.latestOffset({"a": 0}, strict.getDefaultReadLimit())
    finally:
        strict.stop()
    lenient = HeadgateStreamReader(
        SourceOptions.parse(options(data_dir, consumer="live", failOnDataLoss="false"))
    )
    try:
        end = lenient.latestOffset({"a": 0}, lenient.getDefaultReadLimit())
        assert end == {"a": a.end}
        parts = lenient.partitions({"a": 0}, end)
        assert isinstance(parts[0], HeadgatePartition)
        first = parts[0].slices[0]
        assert (first.stream, first.start) == ("a", 2 * TERM)
        report = lenient.reportLatestOffset()
        assert report["a"] == a.end
        assert report["_consumer"] == {
            "name": "live",
            "lag_bytes": {"a": 0},
            "lag_records": {"a": 0},  # no bytes behind: no records
            # A log written without a gateway has no record index: not countable.
            "skipped_bytes": {"a": 2 * TERM},  # counted once, though planned twice
            "skipped_records": {"a": None},
        }
        planned_end = a.end
        a.append([5])
        report = lenient.reportLatestOffset()
        assert report["_consumer"]["lag_bytes"] == {"a": a.end - planned_end}
        assert report["_consumer"]["lag_records"] == {"a": None}  # no record index here
    finally:
        lenient.stop()


# --- without Spark: record addresses -------------------------------------------------


def test_starting_offsets_take_record_addresses_and_refuse_anything_else(data_dir: Path) -> None:
    def starting(value: object) -> object:
        text = json.dumps({"a": value})
        return SourceOptions.parse(options(data_dir, startingOffsets=text)).starting

    assert starting("4096:2") == {"a": "4096:2"}
    assert starting("4096:0") == starting("4096") == starting(4096) == {"a": 4096}
    assert starting(" 7 ") == {"a": 7}
    for hostile, why in [
        (-1, "position -1 is outside 0 to"),
        (2**63, "outside 0 to 9223372036854775807"),
        ("9223372036854775808", "larger than a log position can be"),
        ("1:4294967295", "index 4294967295 is larger than a batch can hold"),
        ("1:-1", "'1:-1' is not a record address"),
        ("-1:0", "'-1:0' is not a record address"),
        ("1:2:3", "not a record address"),
        ("1_000", "not a record address"),
        ("1: 2", "not a record address"),
        ("\u0661", "not a record address"),  # an Arabic-Indic one: int() would take it
        ("", "not a record address"),
        (1.5, "1.5 is not a record address"),
        (True, "True is not a record address"),
        (None, "None is not a record address"),
        ([1, 2], "not a record address"),
    ]:
        with pytest.raises(ValueError, match=rf"option 'startingOffsets': stream 'a': .*{why}"):
            starting(hostile)
    with pytest.raises(ValueError, match=r"must be 'earliest' or 'latest' or a JSON object"):
        SourceOptions.parse(options(data_dir, startingOffsets='{"a": ' + "9" * 5000 + "}"))
    with pytest.raises(ValueError, match=r"position 9{20}\.\.\.\(4000 digits\) is outside"):
        starting(10**4000 - 1)
    with pytest.raises(ValueError, match=r"endingOffsets.*'4096:2' is inside a batch"):
        SourceOptions.parse(options(data_dir, endingOffsets='{"a": "4096:2"}'))
    assert SourceOptions.parse(options(data_dir, endingOffsets='{"a": "64:0"}')).ending == {"a": 64}


def test_a_start_inside_a_batch_is_checked_against_the_log(data_dir: Path) -> None:
    a = make_stream(data_dir, "a")
    a.append([3, 1, 4], release=None)
    second, third = a.frames[1][0], a.frames[2][0]

    def start(value: str) -> object:
        text = json.dumps({"a": value})
        reader = HeadgateStreamReader(SourceOptions.parse(options(data_dir, startingOffsets=text)))
        try:
            return reader.initialOffset()
        finally:
            reader.stop()

    assert start(f"{third}:3") == {"a": f"{third}:3"}
    assert start(f"{second}:0") == {"a": second}
    assert start(str(a.end)) == {"a": a.end}  # the end: new records only
    where = "headgate: option 'startingOffsets': stream 'a': "
    with pytest.raises(SourceError) as past:
        start(f"{third}:4")
    assert str(past.value) == (
        f"{where}record address {third}:4 is past the end of its batch in 'a': the batch at "
        f"position {third} holds 4 records (indexes 0 to 3)"
    )
    with pytest.raises(
        SourceError, match=rf"{where}record address {second}:1 is past .* 1 record "
    ):
        start(f"{second}:1")
    with pytest.raises(SourceError, match=rf"{where}no batch starts at position {second + 8} "):
        start(str(second + 8))
    with pytest.raises(SourceError, match=rf"{where}record address {a.end}:1 is past the end of"):
        start(f"{a.end}:1")
    with pytest.raises(
        SourceError, match=rf"{where}record address 999999 is past the end of the log \({a.end}\)"
    ):
        start("999999")
    b = make_stream(data_dir, "b")
    b.append([10] * 60)
    b.append([1], release=2 * TERM)
    reader = HeadgateStreamReader(
        SourceOptions.parse(options(data_dir, startingOffsets='{"b": "0:1"}'))
    )
    try:
        with pytest.raises(SourceError, match=r"stream 'b': position 0 was already released"):
            reader.initialOffset()
    finally:
        reader.stop()


def test_a_stream_that_starts_inside_a_batch_keeps_its_address_until_it_reads_it(
    data_dir: Path,
) -> None:
    from pyspark.sql.streaming.datasource import ReadMaxRows

    old = make_stream(data_dir, "old")
    old.append([5] * 4, clock=0)
    late = make_stream(data_dir, "late", producer=2)
    late.append([3] * 2, clock=10_000_000)
    inside = f"{late.frames[0][0]}:2"
    reader = HeadgateStreamReader(
        SourceOptions.parse(options(data_dir, startingOffsets=json.dumps({"late": inside})))
    )
    try:
        start = reader.initialOffset()
        assert start == {"late": inside, "old": 0}
        # Oldest first: the old stream's frames fill the batch; "late" does not move
        # and must not become its batch's first record.
        first = reader.latestOffset(start, ReadMaxRows(10))
        assert first == {"late": inside, "old": old.frames[2][0]}
        second = reader.latestOffset(first, ReadMaxRows(100))
        assert second == {"late": late.end, "old": old.end}
        pieces = [p for part in reader.planner.partitions(first, second) for p in part.slices]
        assert {(p.stream, p.start, p.skip) for p in pieces} == {
            ("late", late.frames[0][0], 2),
            ("old", old.frames[2][0], 0),
        }
        rows = [
            r
            for p in pieces
            for b in read_slice(str(data_dir), p, arrow_schema())
            for r in b.to_pylist()
        ]
        got = sorted((r["stream"], r["position"], r["index"], r["sequence"]) for r in rows)
        expected = [r for r in late.rows if (r[1], r[2]) >= (late.frames[0][0], 2)]
        expected += [r for r in old.rows if r[1] >= old.frames[2][0]]
        assert got == sorted((r[0], r[1], r[2], r[4]) for r in expected)
    finally:
        reader.stop()


def test_read_slice_skips_to_the_index_and_refuses_one_past_the_batch(data_dir: Path) -> None:
    a = make_stream(data_dir, "a")
    a.append([4, 2])
    batches = list(read_slice(str(data_dir), StreamSlice("a", 0, a.end, skip=3), arrow_schema()))
    rows = [(r["position"], r["index"], r["sequence"]) for b in batches for r in b.to_pylist()]
    assert rows == [(0, 3, 3), (a.frames[1][0], 0, 4), (a.frames[1][0], 1, 5)]
    with pytest.raises(SourceError, match="the batch at position 0 has no record at index 4"):
        list(read_slice(str(data_dir), StreamSlice("a", 0, a.end, skip=4), arrow_schema()))


# --- with Spark ---------------------------------------------------------------------------


def stream_reader(spark: SparkSession, data_dir: Path, **extra: str) -> DataFrame:
    reader = spark.readStream.format("headgate")
    for key, value in options(data_dir, **extra).items():
        reader = reader.option(key, value)
    return reader.load()


def run_available_now(
    spark: SparkSession,
    data_dir: Path,
    checkpoint: Path,
    table: str,
    **extra: str,
) -> StreamingQuery:
    query = (
        stream_reader(spark, data_dir, **extra)
        .writeStream.format("memory")
        .queryName(table)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120), "the availableNow query did not finish"
    return query


def three_streams(data_dir: Path) -> list[Stream]:
    plain = make_stream(data_dir, "plain", producer=1)
    plain.append([1, 5, 0, 17, 3] * 6, keys="none")
    keyed = make_stream(data_dir, "keyed", producer=2)
    keyed.append([4, 9, 2] * 10, keys="all")
    mixed = make_stream(data_dir, "mixed", producer=3)
    mixed.append([6] * 20, keys="mixed")
    mixed.append([8] * 5, keys="none")
    return [plain, keyed, mixed]


def test_available_now_gives_each_stream_exactly_its_records(
    spark: SparkSession, data_dir: Path, tmp_path: Path
) -> None:
    streams = three_streams(data_dir)
    # Small partitions: many cuts, some across terms, several streams per task.
    query = run_available_now(
        spark, data_dir, tmp_path / "ck", "every_record", bytesPerPartition=str(3 * TERM)
    )
    assert query.exception() is None
    counts = {
        r.stream: (r.n, r.ids, r.null_keys)
        for r in spark.sql(
            "SELECT stream, count(*) AS n, count(DISTINCT producer, sequence) AS ids, "
            "count_if(key IS NULL) AS null_keys FROM every_record GROUP BY stream"
        ).collect()
    }
    assert counts == {
        s.name: (len(s.rows), len(s.rows), sum(r[6] is None for r in s.rows)) for s in streams
    }
    expected = sorted((row for s in streams for row in s.rows), key=lambda r: (r[0], r[1], r[2]))
    assert spark_rows(spark.table("every_record")) == expected
    progress = query.lastProgress
    assert progress is not None
    offsets = json.loads(progress["sources"][0]["endOffset"])
    assert list(offsets.items()) == sorted((s.name, s.end) for s in streams)  # sorted keys


def test_batch_read(spark: SparkSession, data_dir: Path) -> None:
    streams = three_streams(data_dir)
    frame = spark.read.format("headgate").option("path", str(data_dir)).load()
    assert frame.schema == SCHEMA
    assert frame.count() == sum(len(s.rows) for s in streams)

    keyed = streams[1]
    middle = keyed.frames[10][0]
    some = (
        spark.read.format("headgate")
        .option("path", str(data_dir))
        .option("streams", "keyed")
        .option("startingOffsets", json.dumps({"keyed": middle}))
        .option("endingOffsets", json.dumps({"keyed": keyed.frames[20][0]}))
        .load()
    )
    assert spark_rows(some) == [r for r in keyed.rows if middle <= r[1] < keyed.frames[20][0]]


def test_batch_read_of_no_streams(spark: SparkSession, data_dir: Path) -> None:
    (data_dir / "streams" / "being-created").mkdir(parents=True)
    assert spark.read.format("headgate").option("path", str(data_dir)).load().count() == 0


def test_max_records_per_trigger_bounds_every_batch(
    spark: SparkSession, data_dir: Path, tmp_path: Path
) -> None:
    a, b = make_stream(data_dir, "a"), make_stream(data_dir, "b", producer=2)
    a.append([7, 3, 9, 1, 5] * 4, clock=0)
    a.append([40], clock=50_000)  # larger than the limit: a batch of its own
    b.append([2, 8, 4] * 6, clock=100)
    limit = 25
    query = run_available_now(
        spark, data_dir, tmp_path / "ck", "limited", maxRecordsPerTrigger=str(limit)
    )
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    total = len(a.rows) + len(b.rows)
    assert sum(sizes) == total
    assert sorted(s for s in sizes if s > limit) == [40]
    assert len(sizes) >= total // limit
    ids = spark.sql("SELECT count(DISTINCT stream, sequence) AS n FROM limited").first()
    assert ids is not None and ids.n == total


def test_restart_from_the_checkpoint_is_exactly_once(
    spark: SparkSession, data_dir: Path, tmp_path: Path
) -> None:
    a, b = make_stream(data_dir, "a"), make_stream(data_dir, "b", producer=2)
    a.append([10] * 30)
    b.append([5] * 30)
    out, checkpoint = tmp_path / "out", tmp_path / "ck"

    def start(**trigger: Any) -> StreamingQuery:
        return (
            stream_reader(spark, data_dir, maxRecordsPerTrigger="40")
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(**trigger)
            .start()
        )

    first = start(processingTime="0 seconds")
    wait_until(lambda: len(first.recentProgress) >= 2, "two micro-batches")
    first.stop()
    done = spark.read.parquet(str(out)).count()
    assert 0 < done < len(a.rows) + len(b.rows)

    a.append([10] * 5)  # more arrives while the query is down
    second = start(availableNow=True)
    assert second.awaitTermination(120)
    written = spark.read.parquet(str(out))
    written.createOrReplaceTempView("written")
    result = spark.sql(
        "SELECT count(*) AS n, count(DISTINCT stream, producer, sequence) AS ids FROM written"
    ).first()
    assert result is not None
    assert result.n == result.ids == len(a.rows) + len(b.rows)


def test_starting_offsets_json_and_streams_absent_from_it(
    spark: SparkSession, data_dir: Path, tmp_path: Path
) -> None:
    a, b = make_stream(data_dir, "a"), make_stream(data_dir, "b", producer=2)
    a.append([3] * 10)
    b.append([2] * 4)
    from_here = a.frames[6][0]
    run_available_now(
        spark,
        data_dir,
        tmp_path / "ck",
        "from_json",
        startingOffsets=json.dumps({"a": from_here}),
    )
    expected = [r for r in a.rows if r[1] >= from_here] + b.rows
    assert spark_rows(spark.table("from_json")) == sorted(
        expected, key=lambda r: (r[0], r[1], r[2])
    )


def test_starting_offsets_at_a_record_inside_a_batch_start_exactly_there(
    spark: SparkSession, data_dir: Path, tmp_path: Path
) -> None:
    a = make_stream(data_dir, "a")
    a.append([3] * 6)
    some = spark_rows(spark.read.format("headgate").option("path", str(data_dir)).load())
    _, position, index, *_ = some[10]  # the output gives the address ...
    assert index == 1
    run_available_now(
        spark,
        data_dir,
        tmp_path / "ck",
        "from_address",
        startingOffsets=json.dumps({"a": f"{position}:{index}"}),  # ... startingOffsets takes it
    )
    assert spark_rows(spark.table("from_address")) == some[10:]
    batch = spark_rows(
        spark.read.format("headgate")
        .option("path", str(data_dir))
        .option("startingOffsets", json.dumps({"a": f"{position}:2"}))
        .load()
    )
    assert batch == some[11:]


def test_latest_and_a_stream_created_while_running(
    spark: SparkSession, data_dir: Path, tmp_path: Path
) -> None:
    old = make_stream(data_dir, "p-old")
    old.append([4] * 5)
    query = (
        stream_reader(spark, data_dir, startingOffsets="latest", streamPattern="p-.*")
        .writeStream.format("memory")
        .queryName("live")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    try:
        wait_until(lambda: bool(query.recentProgress), "the query's first trigger")
        before = len(old.rows)
        old.append([2] * 3)
        new = make_stream(data_dir, "p-new", producer=9)
        new.append([5] * 4)
        other = make_stream(data_dir, "other")
        other.append([1])
        wait_until(
            lambda: spark.table("live").count() == 3 * 2 + 4 * 5,
            "the new records of p-old and all of p-new",
        )
        query.processAllAvailable()
        assert spark_rows(spark.table("live")) == sorted(
            old.rows[before:] + new.rows, key=lambda r: (r[0], r[1], r[2])
        )
    finally:
        query.stop()


def test_a_vanished_stream_fails_the_query_with_its_name(
    spark: SparkSession, data_dir: Path, tmp_path: Path
) -> None:
    a, b = make_stream(data_dir, "a"), make_stream(data_dir, "b")
    a.append([3] * 3)
    b.append([3] * 3)

    def run() -> StreamingQuery:
        return (
            stream_reader(spark, data_dir)
            .writeStream.format("parquet")
            .option("path", str(tmp_path / "out"))
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
            .start()
        )

    assert run().awaitTermination(120)
    shutil.rmtree(b.directory)
    query = run()
    with pytest.raises(Exception, match=rf"stream 'b': its log directory .* is gone .*{b.end}"):
        query.awaitTermination(120)
