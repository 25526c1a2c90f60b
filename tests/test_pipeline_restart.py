"""What a restarted pipeline relies on, without Spark: the restart rule, the checkpoint's
committed positions, and the scratch directory it empties at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from headgate.config import ConfigError
from headgate.spark.pipeline import committed_positions, pipeline_config_from_dict
from headgate.spark.restarts import RestartPolicy


def test_a_failed_query_restarts_after_growing_delays_until_the_bound() -> None:
    policy = RestartPolicy(max_restarts=3, window=600.0, backoff=(1.0, 5.0))
    assert policy.failed("alpha", now=0.0) == 1.0
    assert policy.failed("alpha", now=10.0) == 5.0
    assert policy.failed("alpha", now=20.0) == 5.0  # the last delay repeats
    assert policy.recent("alpha") == 3
    # A fourth failure within ten minutes is final.
    assert policy.failed("alpha", now=30.0) is None


def test_failures_older_than_the_window_are_forgotten_and_streams_count_apart() -> None:
    policy = RestartPolicy(max_restarts=2, window=100.0, backoff=(2.0,))
    assert policy.failed("alpha", now=0.0) == 2.0
    assert policy.failed("alpha", now=50.0) == 2.0
    assert policy.failed("beta", now=60.0) == 2.0  # beta's failures are its own
    # The one at 0 has left the window: two within it, still allowed.
    assert policy.failed("alpha", now=100.0) == 2.0
    assert policy.recent("alpha") == 2
    assert policy.failed("alpha", now=120.0) is None


def write_checkpoint(
    root: Path, batches: dict[int, dict[str, object]], committed: list[int]
) -> Path:
    """Spark's offset and commit logs as laid out: version, metadata, a line per source."""
    (root / "offsets").mkdir(parents=True)
    (root / "commits").mkdir()
    for batch_id, end in batches.items():
        metadata = '{"batchWatermarkMs":0,"batchTimestampMs":1,"conf":{}}'
        (root / "offsets" / str(batch_id)).write_text(f"v1\n{metadata}\n" + _json(end))
        (root / "offsets" / f".{batch_id}.crc").write_bytes(b"\x00crc")
    for batch_id in committed:
        (root / "commits" / str(batch_id)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    return root


def _json(end: dict[str, object]) -> str:
    import json

    return json.dumps(end)


def test_the_committed_positions_are_the_planned_end_of_the_last_committed_batch(
    tmp_path: Path,
) -> None:
    # Batch 2 was planned (offsets/2) but the driver died before commits/2.
    checkpoint = write_checkpoint(
        tmp_path / "alpha",
        {0: {"alpha": 100}, 1: {"alpha": 2048}, 2: {"alpha": 9000}},
        committed=[0, 1],
    )
    (checkpoint / "commits" / ".2.9f1c.tmp").write_text("half")  # Spark's temp file
    assert committed_positions(checkpoint) == {"alpha": 2048}


def test_a_committed_offset_inside_a_batch_releases_only_up_to_that_batch(
    tmp_path: Path,
) -> None:
    # A query started at record address 4096:2 and read nothing of alpha yet:
    # the batch at 4096 is not read, so the log before it is all that is done.
    checkpoint = write_checkpoint(
        tmp_path / "alpha",
        {0: {"alpha": "4096:2", "beta": 64}},
        committed=[0],
    )
    assert committed_positions(checkpoint) == {"alpha": 4096, "beta": 64}
    for hostile in ("4096:-1", "nonsense", True, -5):
        bad = write_checkpoint(
            tmp_path / f"bad-{hostile}", {0: {"alpha": hostile, "beta": 64}}, committed=[0]
        )
        assert committed_positions(bad) == {"beta": 64}


def test_a_checkpoint_with_nothing_committed_or_unreadable_releases_nothing(
    tmp_path: Path,
) -> None:
    assert committed_positions(tmp_path / "never-started") == {}
    planned_only = write_checkpoint(tmp_path / "a", {0: {"alpha": 10}}, committed=[])
    assert committed_positions(planned_only) == {}
    garbled = write_checkpoint(tmp_path / "b", {0: {"alpha": 10}}, committed=[0])
    (garbled / "offsets" / "0").write_text("v1\n{}\nnot json\n")
    assert committed_positions(garbled) == {}


def config(tmp_path: Path, **top: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "data_dir": str(tmp_path / "data"),
        "streams": {"alpha": {}},
    }
    raw.update(top)
    return raw


def test_spark_scratch_space_is_under_the_checkpoints_unless_set(tmp_path: Path) -> None:
    default = pipeline_config_from_dict(config(tmp_path))
    assert default.spark_local_dir() == tmp_path / "data" / "checkpoints" / "_spark-local"
    chosen = pipeline_config_from_dict(config(tmp_path, local_dir=str(tmp_path / "scratch")))
    assert chosen.spark_local_dir() == tmp_path / "scratch"


@pytest.mark.parametrize(
    "local_dir",
    ["data", "data/checkpoints", "data/checkpoints/alpha", "data/parquet", "."],
)
def test_a_scratch_space_that_holds_data_is_refused(tmp_path: Path, local_dir: str) -> None:
    # It is emptied at every start: pointing it at data would delete the data.
    with pytest.raises(ConfigError, match=r"local_dir .* emptied at every start"):
        pipeline_config_from_dict(config(tmp_path, local_dir=str(tmp_path / local_dir)))
