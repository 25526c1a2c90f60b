"""What each micro-batch goes through: values parsed, the SQL transform, rows into Parquet.

For each stream the pipeline's file (:mod:`headgate.spark.pipeline_config`)
says how values are parsed (JSON with a DDL schema, CSV with a DDL schema,
or raw bytes), an optional SQL transform over a view named after the
stream, and a Parquet sink. Records that do not parse never stop the query:
they go to a dead-letter dataset with the raw bytes, the stream, the
position and the error.

Everything is checked once before a query starts (:func:`plan_stream`,
over an empty frame), so a mistake is a ConfigError naming the file and
the key, not a failed batch.

Exactly once: each micro-batch is written by ``foreachBatch`` into a staging
directory and then moved into the dataset under names that carry the batch
id, replacing whatever an earlier attempt of the same batch left
(:func:`commit_batch`). Spark's checkpoint fixes which offsets a batch id
covers, so a replayed batch writes the same rows under the same names.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headgate.config import ConfigError
from headgate.spark.errors import error_text, quiet_spark_errors
from headgate.spark.pipeline_config import (
    META_COLUMNS,
    PipelineConfig,
    StreamPipeline,
    meta_columns,
)

__all__ = [
    "CORRUPT_COLUMN",
    "StreamPlan",
    "check_pipeline",
    "commit_batch",
    "parse_batch",
    "plan_stream",
    "transform_batch",
]


#: The parsed struct's extra field that Spark fills with a record it cannot parse.
CORRUPT_COLUMN = "_headgate_corrupt_record"


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """What a stream's micro-batches go through, checked once before the query starts."""

    stream: StreamPipeline
    #: The DDL Spark parses values with (the schema plus the corrupt-record field).
    parse_ddl: str | None
    #: The schema's own field names, in order.
    fields: tuple[str, ...]
    #: The SQL view's name, quoted when the stream name is not a plain identifier.
    view: str
    #: The record's columns kept in each row (see :func:`meta_columns`).
    columns: tuple[str, ...] = META_COLUMNS


def plan_stream(spark: Any, config: PipelineConfig, stream: StreamPipeline) -> StreamPlan:
    """Check a stream's schema, transform and partition columns against Spark's analyser.

    Runs over an empty frame, so it costs no data and no job, and turns every
    mistake into a ConfigError that names the file and the key.

    Raises:
        ConfigError: the DDL does not parse, the SQL does not analyse, or a
            partition column is not in the output.
    """
    from pyspark.sql.types import StructType, _parse_datatype_string

    from headgate.spark.source import source_schema

    at = f"{config.origin}: streams.{stream.name}"
    columns = meta_columns(config)
    view = stream.name if stream.name.isidentifier() else f"`{stream.name}`"
    parse_ddl = None
    fields: tuple[str, ...] = ()
    if stream.schema is not None:
        try:
            parsed = _parse_datatype_string(stream.schema)
        except Exception as exc:
            raise ConfigError(f"{at}.schema: not a DDL schema: {error_text(exc)}") from None
        if not isinstance(parsed, StructType) or not parsed.fields:
            raise ConfigError(f'{at}.schema: needs at least one field, e.g. "a INT, b STRING"')
        fields = tuple(parsed.fieldNames())
        lower = [f.lower() for f in fields]
        for name in fields:
            if name.lower() in columns or lower.count(name.lower()) > 1:
                raise ConfigError(
                    f"{at}.schema: field {name!r} is there twice, or clashes with a column "
                    f"the pipeline adds ({', '.join(columns)})"
                )
            if name == CORRUPT_COLUMN:
                raise ConfigError(f"{at}.schema: {CORRUPT_COLUMN} is reserved")
        parse_ddl = _with_corrupt_column(spark, parsed)
    plan = StreamPlan(stream=stream, parse_ddl=parse_ddl, fields=fields, view=view, columns=columns)
    empty = spark.createDataFrame([], source_schema(config.cluster is not None))
    try:
        good, _ = parse_batch(plan, empty)
    except Exception as exc:
        raise ConfigError(f"{at}: cannot parse {stream.format}: {error_text(exc)}") from None
    if stream.transform is not None:
        try:
            good = transform_batch(plan, good)
            good.schema  # noqa: B018 (forces the analysis)
        except Exception as exc:
            raise ConfigError(f"{at}.transform: {error_text(exc)}") from None
    columns = good.columns
    missing = [c for c in stream.partition_by if c not in columns]
    if missing:
        raise ConfigError(
            f"{at}.partition_by: {', '.join(missing)} not among the output columns "
            f"({', '.join(columns)})"
        )
    if stream.partition_by and len(stream.partition_by) == len(columns):
        raise ConfigError(f"{at}.partition_by: Parquet needs a column that is not a partition")
    return plan


def _with_corrupt_column(spark: Any, schema: Any) -> str:
    """The DDL of ``schema`` plus the field Spark puts unparsable records in."""
    from pyspark.sql.types import StringType, StructField, StructType

    extended = StructType([*schema.fields, StructField(CORRUPT_COLUMN, StringType())])
    try:
        # Spark's own DDL writer quotes every name that needs it, nested ones too.
        jvm_type = spark.sparkContext._jvm.org.apache.spark.sql.types.DataType
        return str(jvm_type.fromJson(extended.json()).toDDL())
    except Exception:  # no JVM at hand (Spark Connect): names quoted at the top level
        return ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in extended.fields)


def parse_batch(plan: StreamPlan, batch: Any) -> tuple[Any, Any | None]:
    """Split a batch into parsed rows and dead letters (None for raw values)."""
    from pyspark.sql import functions as F

    stream = plan.stream
    if plan.parse_ddl is None:
        return batch.select(*plan.columns, "key", "value"), None
    text = F.col("value").cast("string")
    options = {
        **dict(stream.options),
        "mode": "PERMISSIVE",
        "columnNameOfCorruptRecord": CORRUPT_COLUMN,
    }
    if stream.format == "json":
        parsed = F.from_json(text, plan.parse_ddl, options)
    else:
        parsed = F.from_csv(text, F.lit(plan.parse_ddl), options)
    with_parsed = batch.withColumn("_parsed", parsed)
    struct = with_parsed["_parsed"]
    corrupt = struct.getField(CORRUPT_COLUMN)
    # Bad: Spark could not parse it, or not one field of the schema is in it.
    found = F.lit(False)
    for name in plan.fields:
        found = found | struct.getField(name).isNotNull()
    ok = corrupt.isNull() & found
    good = with_parsed.where(ok).select(
        *plan.columns, *[struct.getField(n).alias(n) for n in plan.fields]
    )
    bad = with_parsed.where(~ok).select(
        "stream",
        "position",
        "index",
        "producer",
        "sequence",
        F.col("value").alias("raw"),
        F.when(
            corrupt.isNotNull(),
            F.lit(f"value is not valid {stream.format} for schema {stream.schema}"),
        )
        .otherwise(F.lit(f"none of the fields of schema {stream.schema} is in the value"))
        .alias("error"),
    )
    return good, bad


def transform_batch(plan: StreamPlan, good: Any) -> Any:
    """The stream's SQL over its parsed rows (a view named after the stream); the rows if none."""
    if plan.stream.transform is None:
        return good
    good.createOrReplaceTempView(plan.view)
    return good.sparkSession.sql(plan.stream.transform)


def check_pipeline(spark: Any, config: PipelineConfig) -> dict[str, StreamPlan]:
    """Check every stream with Spark's analyser; see :func:`plan_stream`."""
    restore = quiet_spark_errors()
    try:
        return {s.name: plan_stream(spark, config, s) for s in config.streams}
    finally:
        restore()


def commit_batch(frame: Any, target: Path, batch_id: int, partition_by: tuple[str, ...]) -> int:
    """Write one micro-batch's rows into ``target`` idempotently; return the row count."""
    staging = target / ".staging" / str(batch_id)
    shutil.rmtree(staging, ignore_errors=True)
    writer = frame.write.mode("overwrite")
    if partition_by:
        writer = writer.partitionBy(*partition_by)
    writer.parquet(str(staging))
    prefix = f"batch-{batch_id:012d}-"
    # Whatever an earlier attempt of this batch moved in is replaced.
    for old in target.rglob(prefix + "*"):
        old.unlink()
    count = 0
    for part in staging.rglob("*.parquet"):
        relative = part.parent.relative_to(staging)
        destination = target / relative
        destination.mkdir(parents=True, exist_ok=True)
        os.replace(part, destination / f"{prefix}{part.name}")
        count += 1
    shutil.rmtree(staging, ignore_errors=True)
    return count
