"""``headgate query``: rows of the pipeline's Parquet, or one line that says why not."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from headgate.spark.query import QueryError, run_query


def test_a_query_shows_rows_and_a_bad_one_is_one_line_without_sparks_log_record(
    spark: SparkSession, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    dataset = tmp_path / "parquet" / "query_ticks"
    dataset.mkdir(parents=True)
    pq.write_table(pa.table({"price": [1, 2, 3]}), dataset / "part-0.parquet")
    run_query(spark, "SELECT sum(price) AS total FROM query_ticks", tmp_path)
    assert "|total|" in capfd.readouterr().out.replace(" ", "")

    # Issue 14: PySpark logged a multi-kilobyte JSON record before the error.
    with pytest.raises(QueryError) as failed:
        run_query(spark, "SELECT nosuch FROM query_ticks", tmp_path)
    assert str(failed.value).startswith("[UNRESOLVED_COLUMN.WITH_SUGGESTION] ")
    assert "`nosuch`" in str(failed.value) and "\n" not in str(failed.value)
    out, err = capfd.readouterr()
    assert "SQLQueryContextLogger" not in out + err
    assert len(err) < 1000, err
