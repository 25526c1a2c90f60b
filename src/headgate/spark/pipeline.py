"""The pipeline: one Structured Streaming query per stream, logs to Parquet.

For each stream the TOML file describes how values are parsed (JSON with a
DDL schema, CSV with a DDL schema, or raw bytes), an optional SQL transform
over a view named after the stream, and a Parquet sink. Records that do not
parse never stop the query: they go to a dead-letter dataset with the raw
bytes, the stream, the position and the error.

Exactly once: each micro-batch is written by ``foreachBatch`` into a staging
directory and then moved into the dataset under names that carry the batch
id, replacing whatever an earlier attempt of the same batch left. Spark's
checkpoint fixes which offsets a batch id covers, so a replayed batch writes
the same rows under the same names.

Credit: after each committed micro-batch (the last one of a run included),
a :class:`~pyspark.sql.streaming.StreamingQueryListener` hands the committed
end offsets to ``release``, which tells the gateway; the gateway frees that
log space and turns it into guarantees for the stream's producers.

The TOML file (``headgate pipeline CONFIG.toml``; ``examples/pipeline.toml``
shows every key)::

    data_dir = "./headgate-data"        # the gateway's data directory, read locally
    gateway = "127.0.0.1:7878"          # where releases go (or "unix:/run/headgate.sock")
    # cluster = "cluster.toml"          # or: a fleet, instead of gateway (data_dir then
                                        # only places the outputs); each [streams.NAME]
                                        # is a partitioned stream of it
    token_env = "HEADGATE_TOKEN"        # a gateway with tokens: admin (releases), read
    tls_ca_file = "ca.pem"              # a TLS gateway, verified with this CA
    missing_streams = "wait"            # a stream not there yet: wait for it ("fail")
    local_dir = "./spark-scratch"       # spark.local.dir, emptied at start
                                        # (default <checkpoint_dir>/_spark-local)

    [streams.ticks]
    format = "json"
    schema = "symbol STRING, price DOUBLE, ts TIMESTAMP"
    transform = "SELECT symbol, price, ts FROM ticks WHERE price > 0"
    partition_by = ["symbol"]
    trigger_seconds = 1.0
    max_records_per_trigger = 100000
    consumer = "archive"                # the gateway consumer its releases name
                                        # (default: the pipeline file's name)
    blocking = true                     # its pace throttles the producers (default)
    fail_on_data_loss = true            # false: skip what the log freed unread

Consumers: each stream's releases name a consumer of that stream on the
gateway (PROTOCOL.md, "Consumers"). Its default is the pipeline file's name
without ``.toml`` (``archive.toml`` releases as consumer ``archive``), so two
pipeline files on one stream never share a consumer, and so never free what
the other has not read, unless they say so. The consumer is declared on the
gateway before any query starts (:func:`declare_consumers`; its token needs
``admin`` or a ``consume`` pattern matching ``STREAM/CONSUMER``). A
configuration built from a dict, as ``headgate run`` builds its own, releases
as ``default``, the consumer a stream has when nobody declared one.

Every structural mistake is found by :func:`load_pipeline_config` without
Spark; schemas, transforms and partition columns are checked by Spark's
analyser over an empty frame (:func:`check_pipeline`) before any query
starts. Both raise :class:`~headgate.config.ConfigError` naming the file and
the key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headgate.client.security import ClientSecurity, SecurityError
from headgate.config import ConfigError, parse_size
from headgate.log.address import AddressError
from headgate.protocol.messages import DEFAULT_CONSUMER, is_valid_name
from headgate.spark.planning import MISSING_STREAMS, offset_address
from headgate.tomlfile import expect_table, read_toml, refuse_unknown

Release = Callable[[str, int], None]

FORMATS = ("json", "csv", "raw")

log = logging.getLogger("headgate.pipeline")

#: Columns every output row starts with (before the parsed fields or the raw key and value).
#: ``position`` and ``index`` are the record's address (``headgate tail --from``).
META_COLUMNS = ("stream", "position", "index", "producer", "sequence", "ingest_time")
#: With a cluster, the rows also carry the partition's number (the source's FLEET_SCHEMA).
FLEET_META_COLUMNS = ("stream", "partition", *META_COLUMNS[1:])

# Parser options a stream may set, per format (Spark's from_json / from_csv
# options that apply to one record). "mode" and "columnNameOfCorruptRecord"
# are the pipeline's own: bad records must go to the dead letters, never stop
# the query.
PARSER_OPTIONS = {
    "csv": frozenset(
        {
            "sep",
            "delimiter",
            "quote",
            "escape",
            "charToEscapeQuoteEscaping",
            "comment",
            "ignoreLeadingWhiteSpace",
            "ignoreTrailingWhiteSpace",
            "nullValue",
            "emptyValue",
            "nanValue",
            "positiveInf",
            "negativeInf",
            "dateFormat",
            "timestampFormat",
            "timestampNTZFormat",
            "enableDateTimeParsingFallback",
            "locale",
            "maxCharsPerColumn",
            "unescapedQuoteHandling",
        }
    ),
    "json": frozenset(
        {
            "primitivesAsString",
            "prefersDecimal",
            "allowComments",
            "allowUnquotedFieldNames",
            "allowSingleQuotes",
            "allowNumericLeadingZeros",
            "allowBackslashEscapingAnyCharacter",
            "allowUnquotedControlChars",
            "allowNonNumericNumbers",
            "dateFormat",
            "timestampFormat",
            "timestampNTZFormat",
            "enableDateTimeParsingFallback",
            "locale",
        }
    ),
}

#: The parsed struct's extra field that Spark fills with a record it cannot parse.
CORRUPT_COLUMN = "_headgate_corrupt_record"

#: How the gateway is reached safely: the token's source (never the token
#: itself: config files get shared and committed) and TLS.
_SECURITY_KEYS = (
    "token_env",
    "token_file",
    "tls",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_server_name",
)

_TOP_KEYS = (
    "data_dir",
    "gateway",
    "read_through_gateway",
    "cluster",
    "output_dir",
    "checkpoint_dir",
    "local_dir",
    "missing_streams",
    "streams",
    *_SECURITY_KEYS,
)


@dataclass(frozen=True, slots=True)
class StreamPipeline:
    """How one stream is parsed, transformed and written."""

    #: The stream name (also the name of the SQL view).
    name: str
    #: json, csv or raw.
    format: str = "raw"
    #: DDL schema of the parsed value (json and csv).
    schema: str | None = None
    #: Parser options (Spark's from_json / from_csv options), as text.
    options: tuple[tuple[str, str], ...] = ()
    #: Optional SQL over the view named after the stream.
    transform: str | None = None
    #: Parquet directory; None for ``<output_dir>/<name>``.
    output: Path | None = None
    #: Parquet partition columns of the transformed rows.
    partition_by: tuple[str, ...] = ()
    #: Checkpoint directory; None for ``<checkpoint_dir>/<name>``.
    checkpoint: Path | None = None
    #: Micro-batch interval in seconds.
    trigger_seconds: float = 1.0
    #: Admission control per micro-batch.
    max_records_per_trigger: int | None = None
    max_bytes_per_trigger: int | None = None
    #: The gateway consumer whose position the stream's releases commit.
    consumer: str = DEFAULT_CONSUMER
    #: Whether that consumer holds the producers back (declared so).
    blocking: bool = True
    #: A batch whose start the log freed before it was read: fail the query
    #: (True), or skip to the oldest held position (the source's ``failOnDataLoss``).
    fail_on_data_loss: bool = True


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Where to read, where to write, and the streams."""

    data_dir: Path
    streams: tuple[StreamPipeline, ...]
    #: Where releases go (``host:port`` or ``unix:PATH``); None: nowhere.
    gateway: str | None = None
    output_dir: Path = field(default=Path())
    checkpoint_dir: Path = field(default=Path())
    #: Spark's scratch space (``spark.local.dir``); None for ``<checkpoint_dir>/_spark-local``.
    #: ``headgate pipeline`` empties it at start: only its own earlier runs write there.
    local_dir: Path | None = None
    #: Read the logs through ``gateway`` instead of from ``data_dir``.
    read_through_gateway: bool = False
    #: The token's source and TLS settings for ``gateway`` (releases and reads).
    security: ClientSecurity = field(default_factory=ClientSecurity)
    #: A fleet's cluster file (``cluster``): every stream is a partitioned
    #: stream of it, read and released through each partition's gateway.
    cluster: Path | None = None
    #: A stream that does not exist when its query starts: ``fail`` the query
    #: (a misspelt name), or ``wait`` for its first producer (the source's
    #: ``missingStreams`` option).
    missing_streams: str = "fail"
    #: What error messages call this configuration (its file name).
    origin: str = "pipeline"

    def stream(self, name: str) -> StreamPipeline:
        return next(s for s in self.streams if s.name == name)

    def output(self, stream: str) -> Path:
        override = self.stream(stream).output
        return override if override is not None else self.output_dir / stream

    def checkpoint(self, stream: str) -> Path:
        override = self.stream(stream).checkpoint
        return override if override is not None else self.checkpoint_dir / stream

    def dead_letters(self, stream: str) -> Path:
        return self.output_dir / "_dead_letters" / stream

    def spark_local_dir(self) -> Path:
        """Where Spark keeps shuffle and block files (``blockmgr-*``, ``spark-*``).

        Under the pipeline's own checkpoint directory by default, so that what
        a killed driver leaves behind is found and removed by the next start,
        not piled up in the system's temp folder. No stream can be named
        ``_spark-local`` (names start with a letter or a digit).
        """
        if self.local_dir is not None:
            return self.local_dir
        return self.checkpoint_dir / "_spark-local"


#: The file in each stream's checkpoint that records what the query was made for.
DEFINITION_FILE = "headgate-definition.json"


def meta_columns(config: PipelineConfig) -> tuple[str, ...]:
    """The record's columns the pipeline adds to each output row (``partition`` for a fleet)."""
    return FLEET_META_COLUMNS if config.cluster is not None else META_COLUMNS


def query_definition(config: PipelineConfig, stream: str) -> dict[str, Any]:
    """What a checkpoint is only valid for: how records are read, shaped and where they go.

    Read limits and the trigger interval are not part of it: Spark resumes a
    checkpoint under new ones.
    """
    spec = config.stream(stream)
    return {
        "stream": spec.name,
        # The columns the pipeline adds: a checkpoint from before ``index``
        # was one of them has no such key, and is refused like any change.
        "columns": list(meta_columns(config)),
        "format": spec.format,
        "schema": spec.schema,
        "options": [list(pair) for pair in spec.options],
        "transform": spec.transform,
        "partition_by": list(spec.partition_by),
        "output": str(config.output(stream).resolve()),
        "dead_letters": str(config.dead_letters(stream).resolve()),
    }


def check_definitions(config: PipelineConfig, *, write_new: bool = True) -> None:
    """Refuse a checkpoint made for another definition of its query; record new ones.

    Resuming a checkpoint under a new format, schema or transform would write
    rows of two shapes into one dataset (or into another one), which a reader
    then miscounts without a word.

    ``write_new``: False only checks, for a caller that has not yet had the
    definitions checked by Spark's analyser (a bad schema must not be recorded).

    Raises:
        ConfigError: a stream's checkpoint belongs to another definition; the
            message names what changed and how to start over.
    """
    for spec in config.streams:
        checkpoint = config.checkpoint(spec.name)
        record = checkpoint / DEFINITION_FILE
        wanted = query_definition(config, spec.name)
        if record.exists():
            try:
                stored = json.loads(record.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"{config.origin}: stream {spec.name!r}: cannot read {record}: {exc}"
                ) from None
            if not isinstance(stored, dict):
                stored = {}
            changed = [key for key in wanted if stored.get(key) != wanted[key]]
            if changed:
                why = f"{', '.join(changed)} changed"
                if "columns" in changed:  # a checkpoint of an older headgate
                    why += f"; rows now carry {', '.join(meta_columns(config))}"
                raise ConfigError(
                    f"{config.origin}: stream {spec.name!r}: its checkpoint {checkpoint} "
                    f"was made for another definition ({why}). "
                    f"To start over, delete {checkpoint} and {config.output(spec.name)}, "
                    "or give the stream a new checkpoint and output directory"
                )
            continue
        if (checkpoint / "offsets").is_dir() and any((checkpoint / "offsets").iterdir()):
            # Spark has run this query, under a headgate that recorded no
            # definitions: its rows had no ``index`` column.
            raise ConfigError(
                f"{config.origin}: stream {spec.name!r}: its checkpoint {checkpoint} was made "
                f"by an older headgate, whose rows lacked columns they now carry "
                f"({', '.join(meta_columns(config))}). To start over, delete {checkpoint} and "
                f"{config.output(spec.name)}, or give the stream a new checkpoint and output "
                "directory"
            )
        if not write_new:
            continue
        # A new checkpoint: record what it is for.
        checkpoint.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(".tmp")
        partial.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
        os.replace(partial, record)


def load_pipeline_config(path: Path) -> PipelineConfig:
    """Read a pipeline TOML file; every mistake is a ConfigError naming it.

    A stream without ``consumer`` releases as the consumer named after the
    file (its name without the suffix): see the module docstring.
    """
    raw = read_toml(path, "pipeline", ConfigError)
    return pipeline_config_from_dict(raw, where=str(path), default_consumer=path.stem)


def _path(value: object, what: str) -> Path:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{what} must be a non-empty path, got {value!r}")
    return Path(value)


def _security_from_dict(raw: dict[str, Any], remote: bool, where: str) -> ClientSecurity:
    """The token source and TLS keys; files must load. The token itself is read at start."""
    from headgate.client.address import GatewayAddress

    given = {key: raw[key] for key in _SECURITY_KEYS if key in raw}
    if not given:
        return ClientSecurity()
    if not remote:
        raise ConfigError(f"{where}: {', '.join(given)} need(s) a gateway address")
    tls = given.pop("tls", False)
    if not isinstance(tls, bool):
        raise ConfigError(f"{where}: tls must be true or false, got {tls!r}")
    for key, value in given.items():
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}: {key} must be non-empty text, got {value!r}")
    if "token_env" in given and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", given["token_env"]):
        raise ConfigError(
            f"{where}: token_env must name an environment variable, got {given['token_env']!r}"
        )
    try:
        security = ClientSecurity(
            token_env=given.get("token_env"),
            token_file=given.get("token_file"),
            tls=tls,
            ca_file=given.get("tls_ca_file"),
            cert_file=given.get("tls_cert_file"),
            key_file=given.get("tls_key_file"),
            server_name=given.get("tls_server_name"),
        )
        security.ssl_context()
        if "gateway" in raw:
            security.check_address(GatewayAddress.parse(raw["gateway"]))
    except SecurityError as exc:
        text = str(exc).replace("token_env and token_file", "token_env or token_file")
        text = text.replace("cert_file", "tls_cert_file")
        raise ConfigError(f"{where}: {text}") from None
    return security


def _cluster_from_dict(raw: dict[str, Any], where: str) -> Path:
    """The ``cluster`` key: a cluster file that loads, instead of ``gateway``
    (``data_dir`` then only places the outputs and checkpoints)."""
    from headgate.cluster import ClusterError, load_cluster

    clashing = [k for k in ("gateway", "read_through_gateway") if k in raw]
    if clashing:
        raise ConfigError(
            f"{where}: cluster reads and releases through the fleet's gateways; "
            f"leave out {', '.join(clashing)}"
        )
    path = _path(raw["cluster"], f"{where}: cluster")
    try:
        load_cluster(path)
    except ClusterError as exc:
        raise ConfigError(f"{where}: cluster: {exc}") from None
    return path


def _option_text(value: object, what: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise ConfigError(f"{what} must be text, a number or true/false, got {value!r}")


def _stream_from_table(
    name: str, entry: object, at: str, default_consumer: str | None
) -> StreamPipeline:
    if not is_valid_name(name):
        raise ConfigError(
            f"{at}: {name!r} is not a stream name (letters, digits, '.', '_' and '-', "
            "starting with a letter or digit)"
        )
    table = expect_table(entry, at, ConfigError, f"a table ([streams.{name}])")
    known = frozenset(f for f in StreamPipeline.__dataclass_fields__ if f != "name")
    refuse_unknown(table, known, at, ConfigError)
    fmt = table.get("format", "raw")
    if fmt not in FORMATS:
        raise ConfigError(f"{at}.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    schema = table.get("schema")
    if fmt == "raw":
        for key in ("schema", "options"):
            if key in table:
                raise ConfigError(f"{at}.{key}: format raw is not parsed; drop {key} or set format")
    elif not isinstance(schema, str) or not schema.strip():
        raise ConfigError(f'{at}: format {fmt} needs a DDL schema, e.g. "a INT, b STRING"')
    options_raw = table.get("options", {})
    if not isinstance(options_raw, dict):
        raise ConfigError(f"{at}.options must be a table of parser options")
    options = []
    for key, value in options_raw.items():
        if key not in PARSER_OPTIONS.get(fmt, frozenset()):
            raise ConfigError(
                f"{at}.options.{key}: not a {fmt} parser option "
                f"(known: {', '.join(sorted(PARSER_OPTIONS[fmt]))})"
            )
        options.append((key, _option_text(value, f"{at}.options.{key}")))
    partition_by = table.get("partition_by", [])
    if not isinstance(partition_by, list) or not all(
        isinstance(c, str) and c for c in partition_by
    ):
        raise ConfigError(f"{at}.partition_by must be a list of column names")
    if len(set(partition_by)) != len(partition_by):
        raise ConfigError(f"{at}.partition_by names a column twice")
    trigger = table.get("trigger_seconds", 1.0)
    if isinstance(trigger, bool) or not isinstance(trigger, int | float) or trigger <= 0:
        raise ConfigError(f"{at}.trigger_seconds must be a positive number, got {trigger!r}")
    records = table.get("max_records_per_trigger")
    if records is not None and (
        isinstance(records, bool) or not isinstance(records, int) or records < 1
    ):
        raise ConfigError(f"{at}.max_records_per_trigger must be a positive whole number")
    size = table.get("max_bytes_per_trigger")
    if size is not None:
        size = parse_size(size, what=f"{at}.max_bytes_per_trigger")
        if size < 1:
            raise ConfigError(f"{at}.max_bytes_per_trigger must be positive")
    transform = table.get("transform")
    if transform is not None and (not isinstance(transform, str) or not transform.strip()):
        raise ConfigError(f"{at}.transform must be SQL text")
    output = table.get("output")
    checkpoint = table.get("checkpoint")
    consumer = table.get("consumer", default_consumer)
    if consumer is None:
        raise ConfigError(
            f"{at}: the pipeline file's name is not a consumer name (letters, digits, '.', "
            "'_' and '-', starting with a letter or digit); set consumer"
        )
    if not isinstance(consumer, str) or not is_valid_name(consumer):
        raise ConfigError(
            f"{at}.consumer: {consumer!r} is not a consumer name (letters, digits, '.', '_' "
            "and '-', starting with a letter or digit)"
        )
    flags: dict[str, bool] = {}
    for key in ("blocking", "fail_on_data_loss"):
        flag = table.get(key, True)
        if not isinstance(flag, bool):
            raise ConfigError(f"{at}.{key} must be true or false, got {flag!r}")
        flags[key] = flag
    return StreamPipeline(
        name=name,
        format=fmt,
        schema=schema,
        options=tuple(options),
        transform=transform,
        output=None if output is None else _path(output, f"{at}.output"),
        partition_by=tuple(partition_by),
        checkpoint=None if checkpoint is None else _path(checkpoint, f"{at}.checkpoint"),
        trigger_seconds=float(trigger),
        max_records_per_trigger=records,
        max_bytes_per_trigger=size,
        consumer=consumer,
        blocking=flags["blocking"],
        fail_on_data_loss=flags["fail_on_data_loss"],
    )


def pipeline_config_from_dict(
    raw: dict[str, Any], *, where: str = "pipeline", default_consumer: str = DEFAULT_CONSUMER
) -> PipelineConfig:
    """Check a parsed TOML document and build the configuration (no Spark needed).

    ``default_consumer``: the consumer of a stream that names none
    (:func:`load_pipeline_config` gives the file's name).
    """
    if not is_valid_name(default_consumer):
        fallback: str | None = None
    else:
        fallback = default_consumer
    from headgate.client.address import GatewayAddress

    refuse_unknown(raw, _TOP_KEYS, where, ConfigError)
    data_dir = _path(raw.get("data_dir", "headgate-data"), f"{where}: data_dir")
    gateway = raw.get("gateway")
    if gateway is not None:
        if not isinstance(gateway, str):
            raise ConfigError(f"{where}: gateway must be host:port or unix:PATH, got {gateway!r}")
        gateway = str(GatewayAddress.parse(gateway, what=f"{where}: gateway"))
    through = raw.get("read_through_gateway", False)
    if not isinstance(through, bool):
        raise ConfigError(f"{where}: read_through_gateway must be true or false")
    if through and gateway is None:
        raise ConfigError(f"{where}: read_through_gateway = true needs a gateway address")
    cluster = raw.get("cluster")
    if cluster is not None:
        cluster = _cluster_from_dict(raw, where)
    security = _security_from_dict(raw, gateway is not None or cluster is not None, where)
    missing = raw.get("missing_streams", "fail")
    if missing not in MISSING_STREAMS:
        raise ConfigError(
            f"{where}: missing_streams must be {' or '.join(map(repr, MISSING_STREAMS))}, "
            f"got {missing!r}"
        )
    streams_raw = raw.get("streams")
    if not isinstance(streams_raw, dict) or not streams_raw:
        raise ConfigError(f"{where}: needs at least one [streams.NAME] table")
    streams = tuple(
        _stream_from_table(name, table, f"{where}: streams.{name}", fallback)
        for name, table in streams_raw.items()
    )
    output_dir = _path(raw.get("output_dir", str(data_dir / "parquet")), f"{where}: output_dir")
    checkpoint_dir = _path(
        raw.get("checkpoint_dir", str(data_dir / "checkpoints")), f"{where}: checkpoint_dir"
    )
    if cluster is not None:
        from headgate.cluster import load_cluster

        held = load_cluster(cluster).streams
        for spec in streams:
            if spec.name not in held:
                raise ConfigError(
                    f"{where}: streams.{spec.name}: the cluster file {cluster} has no "
                    f"partitioned stream {spec.name!r} (it has: {', '.join(held) or 'none'})"
                )
    local_dir = raw.get("local_dir")
    config = PipelineConfig(
        data_dir=data_dir,
        streams=streams,
        gateway=gateway,
        output_dir=output_dir,
        checkpoint_dir=checkpoint_dir,
        local_dir=None if local_dir is None else _path(local_dir, f"{where}: local_dir"),
        read_through_gateway=through,
        security=security,
        missing_streams=missing,
        origin=where,
        cluster=cluster,
    )
    # The scratch space is emptied at every start: it must hold nothing else.
    scratch = config.spark_local_dir().resolve()
    kept = [("data_dir", data_dir), ("output_dir", output_dir), ("checkpoint_dir", checkpoint_dir)]
    for stream in streams:
        kept.append((f"streams.{stream.name} output", config.output(stream.name)))
        kept.append((f"streams.{stream.name} checkpoint", config.checkpoint(stream.name)))
    for what, kept_place in kept:
        resolved = kept_place.resolve()
        if resolved == scratch or scratch in resolved.parents:
            raise ConfigError(
                f"{where}: local_dir {scratch} would hold the {what} ({resolved}); "
                "it is emptied at every start, so give it a directory of its own"
            )
    # Two queries sharing a checkpoint or an output would corrupt each other.
    for kind, place in (("output", config.output), ("checkpoint", config.checkpoint)):
        seen: dict[Path, str] = {}
        for stream in streams:
            target = place(stream.name).resolve()
            if target in seen:
                raise ConfigError(
                    f"{where}: streams.{stream.name} and streams.{seen[target]} share the "
                    f"{kind} directory {target}"
                )
            seen[target] = stream.name
    return config


def spark_session(app_name: str = "headgate", *, local_dir: Path | None = None) -> Any:
    """A local SparkSession set up for headgate (workers use this interpreter).

    ``local_dir``: Spark's scratch space (``spark.local.dir``) instead of the
    system's temp folder. It applies only when this call starts Spark; a
    session that already runs keeps its own.
    """
    from pyspark.sql import SparkSession

    # An installed headgate does the first line at every interpreter start
    # (setup.py's .pth file); a source tree on PYTHONPATH has no .pth.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master("local[2]")
    if local_dir is not None:
        builder = builder.config("spark.local.dir", str(local_dir))
    spark = (
        builder.appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _commit_batch(frame: Any, target: Path, batch_id: int, partition_by: tuple[str, ...]) -> int:
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


@dataclass(frozen=True, slots=True)
class _Plan:
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


_PYTHON_ERROR = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): (.+)$")


def error_text(exc: BaseException) -> str:
    """One line that says what went wrong in an error from Spark, without its traces.

    An error raised by Python code that Spark ran (a data source) arrives as
    Spark's message around that code's traceback: its last line is the one
    that matters.
    """
    text = str(getattr(exc, "desc", None) or exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last)" in text:
        raised = [m.group(1) for line in lines if (m := _PYTHON_ERROR.match(line))]
        if raised:
            return raised[-1].split(" SQLSTATE:")[0]
    first = lines[0] if lines else type(exc).__name__
    return first.split(" SQLSTATE:")[0]


class BatchError(Exception):
    """A micro-batch's JVM call failed; the message is the Java error's first line."""


@contextlib.contextmanager
def _short_jvm_errors() -> Iterator[None]:
    """Re-raise a JVM error inside ``foreachBatch`` with its first lines only.

    Spark decides whether a failed Python batch was interrupted by its own
    ``stop()`` by matching the error's text against a regular expression
    (``StreamExecution.isInterruptionException``) that recurses once per
    character: on a Java stack trace of a few hundred lines it throws
    StackOverflowError in the stream thread, which prints its own trace. The
    short message keeps what the expression looks for (the Py4J line and the
    Java exception) and what a person needs.
    """
    from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]

    try:
        yield
    except Py4JJavaError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:2]
        called = lines[0].rstrip(".") if lines else "An error occurred while calling the JVM"
        java = lines[1].lstrip(": ") if len(lines) > 1 else type(exc).__name__
        raise BatchError(f"py4j.protocol.Py4JJavaError: {called}: {java}") from None


def _quiet_spark_errors() -> Callable[[], None]:
    """Silence the loggers with which PySpark prints each analysis error and its JVM trace.

    The pipeline turns those errors into one plain message; return a function
    that restores the loggers.
    """
    from pyspark.logger import PySparkLogger

    # Created through PySpark, whose calls pass keywords only its class takes.
    loggers = [
        PySparkLogger.getLogger(name)
        for name in ("DataFrameQueryContextLogger", "SQLQueryContextLogger")
    ]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True

    def restore() -> None:
        for logger, disabled in zip(loggers, before, strict=True):
            logger.disabled = disabled

    return restore


def plan_stream(spark: Any, config: PipelineConfig, stream: StreamPipeline) -> _Plan:
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
    plan = _Plan(stream=stream, parse_ddl=parse_ddl, fields=fields, view=view, columns=columns)
    empty = spark.createDataFrame([], source_schema(config.cluster is not None))
    try:
        good, _ = _parse(plan, empty)
    except Exception as exc:
        raise ConfigError(f"{at}: cannot parse {stream.format}: {error_text(exc)}") from None
    if stream.transform is not None:
        try:
            good = _transform(plan, good)
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


def _parse(plan: _Plan, batch: Any) -> tuple[Any, Any | None]:
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


def _transform(plan: _Plan, good: Any) -> Any:
    if plan.stream.transform is None:
        return good
    good.createOrReplaceTempView(plan.view)
    return good.sparkSession.sql(plan.stream.transform)


def check_pipeline(spark: Any, config: PipelineConfig) -> dict[str, _Plan]:
    """Check every stream with Spark's analyser; see :func:`plan_stream`."""
    restore = _quiet_spark_errors()
    try:
        return {s.name: plan_stream(spark, config, s) for s in config.streams}
    finally:
        restore()


def committed_positions(checkpoint: Path) -> dict[str, int]:
    """The end positions of the last batch a query's checkpoint records as committed.

    Spark writes ``offsets/N`` (the planned end of batch N: a version line, a
    metadata line, then one line per source) before it runs the batch, and
    ``commits/N`` after. The release that followed ``commits/N`` may not have
    reached the gateway before a kill; sending it again at start costs
    nothing (the gateway ignores a release that does not move forward) and
    gives producers their credit back before Spark's first batch, which can
    take minutes over a full log. Anything unreadable counts as nothing
    committed: the listener releases after the first batch, as before.
    """
    commits = checkpoint / "commits"
    try:
        done = sorted((int(f.name) for f in commits.iterdir() if f.name.isdigit()), reverse=True)
    except OSError:
        return {}
    for batch_id in done:
        try:
            lines = (checkpoint / "offsets" / str(batch_id)).read_text().splitlines()
        except OSError:
            continue
        positions: dict[str, int] = {}
        for line in lines[2:]:
            try:
                offset = json.loads(line)
            except ValueError:
                continue
            if isinstance(offset, dict):
                for stream, value in offset.items():
                    with contextlib.suppress(AddressError):
                        positions[str(stream)] = offset_address(value).position
        return positions
    return {}


def release_committed(config: PipelineConfig, release: Release) -> dict[str, int]:
    """Release every stream's committed position (:func:`committed_positions`); return them.

    Needs no Spark, so ``headgate pipeline`` calls it before Spark starts
    (about ten seconds on a busy machine): producers held back while the
    pipeline was down get their credit back then, not after the first batch.
    Call it after :func:`check_definitions`: a checkpoint made for another
    definition must not release anything.
    """
    released: dict[str, int] = {}
    for spec in config.streams:
        for stream, position in committed_positions(config.checkpoint(spec.name)).items():
            release(stream, position)
            released[stream] = position
    return released


def consumer_settings(spec: StreamPipeline) -> Any:
    """How the gateway is asked to declare ``spec``'s consumer (``ConsumerSettings``)."""
    from headgate.config import ConsumerSettings

    return ConsumerSettings(
        blocking=spec.blocking, on_data_loss="fail" if spec.fail_on_data_loss else "skip"
    )


class GatewayReleases:
    """The pipeline's releases to its gateway: one release client per consumer.

    A stream's releases name its consumer (``consumer`` in its table). Each
    client declares its consumer before its first Release of a stream on
    each connection, so a stream created after the pipeline started gets
    the consumer too. :meth:`release` is a :data:`Release`: it routes by
    stream, and never waits.
    """

    def __init__(self, config: PipelineConfig) -> None:
        from headgate.client.control import ReleaseClient

        self._clients: dict[tuple[str, Any], Any] = {}
        self._client_of: dict[str, Any] = {}
        if config.cluster is not None:
            self._fleet(config, config.cluster)
            return
        gateway = config.gateway
        if gateway is None:
            raise ValueError("a pipeline without a gateway has nowhere to release")
        for spec in config.streams:
            key = (spec.consumer, consumer_settings(spec))
            if key not in self._clients:
                self._clients[key] = ReleaseClient(
                    gateway,
                    security=config.security,
                    consumer=spec.consumer,
                    declare=key[1],
                )
            self._client_of[spec.name] = self._clients[key]
        #: Where the releases go.
        self.address = next(iter(self._clients.values())).address

    def _fleet(self, config: PipelineConfig, path: Path) -> None:
        """One :class:`~headgate.spark.fleet.FleetReleases` per consumer; each
        partition's release goes to its gateway."""
        from headgate.cluster import load_cluster
        from headgate.spark.fleet import FleetReleases

        cluster = load_cluster(path)
        for spec in config.streams:
            key = (spec.consumer, consumer_settings(spec))
            if key not in self._clients:
                self._clients[key] = FleetReleases(
                    cluster, config.security, consumer=spec.consumer, declare=key[1]
                )
            for partition in cluster.stream(spec.name).partitions:
                self._client_of[partition.name] = self._clients[key]
        self.address = f"the gateways of cluster file {path}"

    def release(self, stream: str, position: int) -> None:
        """Commit ``stream`` (with a cluster: a partition's log) up to ``position``
        for the stream's consumer."""
        self._client_of[stream].release(stream, position)

    def applied(self) -> dict[str, int]:
        """Per stream, the newest position the gateway confirmed having applied."""
        applied: dict[str, int] = {}
        from headgate.spark.fleet import FleetReleases

        for client in self._clients.values():
            applied.update(
                client.applied()
                if isinstance(client, FleetReleases)
                else client.statistics().applied
            )
        return applied

    def close(self, timeout: float = 5.0) -> bool:
        """Flush and close every client; True if the gateway confirmed every release."""
        return all([client.close(timeout) for client in self._clients.values()])


def declare_consumers(config: PipelineConfig, timeout: float = 10.0) -> dict[str, int]:
    """Declare each stream's consumer on the gateway, before any query runs.

    A pipeline must hold the log from its start: a consumer declared only at
    its first Release starts at the oldest position the log still holds, and
    another consumer may have freed the log past where this one's first batch
    reads meanwhile. Returns each declared consumer's committed position, by
    stream (with a cluster: on every partition's gateway, by partition log).
    A stream the gateway does not have yet is skipped (its release client
    declares the consumer with its first Release); so is a gateway that
    cannot be reached (logged: the same happens then).

    Raises:
        ConfigError: the token may not declare the consumer (it needs
            ``admin``, or a ``consume`` pattern matching ``STREAM/CONSUMER``),
            or the consumer exists with other settings.
    """
    import asyncio

    from headgate.client.reader import Reader, ReaderError, ReaderRefused
    from headgate.protocol.errors import ErrorCode

    targets = _consumer_targets(config)
    positions: dict[str, int] = {}

    async def declare(target: _ConsumerTarget) -> None:
        spec = target.spec
        settings = consumer_settings(spec)
        async with Reader(
            target.gateway,
            security=target.security,
            client_name="headgate-pipeline",
            connect_timeout=timeout,
        ) as reader:
            positions[target.log] = await reader.declare_consumer(
                target.log,
                spec.consumer,
                blocking=settings.blocking,
                skip_data_loss=settings.on_data_loss == "skip",
            )

    def run(target: _ConsumerTarget) -> None:
        coroutine = asyncio.wait_for(declare(target), timeout * 2)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(coroutine)
            return
        # Called from a thread with a running event loop: run it beside it.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, coroutine).result()

    for target in targets:
        spec, gateway = target.spec, target.gateway
        try:
            run(target)
        except ReaderRefused as exc:
            if exc.code in (ErrorCode.UNEXPECTED_FRAME, ErrorCode.RECOVERING) and (
                "no stream called" in exc.text or exc.code is ErrorCode.RECOVERING
            ):
                log.info(
                    "stream %s: not on the gateway yet; its consumer is declared "
                    "with its first release",
                    target.log,
                )
                continue
            raise ConfigError(
                f"{config.origin}: streams.{spec.name}: the gateway at {gateway} refused to "
                f"declare consumer {spec.consumer!r} of stream {target.log!r}: {exc.text}"
                + (
                    f" (the token needs admin, or a consume pattern matching "
                    f"{target.log}/{spec.consumer}; or set consumer to one it may use)"
                    if exc.code is ErrorCode.FORBIDDEN
                    else ""
                )
            ) from None
        except (ReaderError, TimeoutError, OSError) as exc:
            log.warning(
                "cannot declare consumer %s of stream %s at the gateway %s now (%s); it is "
                "declared with the first release",
                spec.consumer,
                target.log,
                gateway,
                exc,
            )
    return positions


@dataclass(frozen=True, slots=True)
class _ConsumerTarget:
    """One stream log whose consumer the pipeline declares, and where it is."""

    spec: StreamPipeline
    #: The stream log: the stream itself, or (with a cluster) one partition's.
    log: str
    gateway: str
    security: ClientSecurity


def _consumer_targets(config: PipelineConfig) -> list[_ConsumerTarget]:
    """Every stream log the pipeline's consumers are declared on: each stream on
    the gateway, or each partition on the gateway that holds it."""
    if config.cluster is not None:
        from headgate.cluster import load_cluster
        from headgate.spark.fleet import security_for

        cluster = load_cluster(config.cluster)
        return [
            _ConsumerTarget(
                spec,
                partition.name,
                cluster.gateways[partition.gateway].address,
                security_for(cluster, partition.gateway, config.security),
            )
            for spec in config.streams
            for partition in cluster.stream(spec.name).partitions
        ]
    if config.gateway is None:
        return []
    return [_ConsumerTarget(s, s.name, config.gateway, config.security) for s in config.streams]


#: A key the pipeline leaves in the data source's shared environment once it is settled.
_SETTLED_MARK = "HEADGATE_SOURCE_ENVIRONMENT_SETTLED"


def _settle_source_environment(spark: Any) -> None:
    """Work around a Spark race that fails a query's batch with "Illegal size N of collection".

    Spark keeps one environment map (a Scala ``mutable.HashMap``) for the
    ``headgate`` data source in the whole JVM, shared by every query that
    reads it. Each query's start (``PythonStreamingSourceRunner.init``) puts
    its worker settings into that very map, and every task of every batch
    serializes it (inside the partition reader factory). When one query's
    start changes the map's structure while another query's batch is being
    serialized, the serializer counts fewer entries than it announced and the
    job fails with ``Task serialization failed: IllegalStateException:
    Illegal size 5 of collection, expected 7``. A restart over a full log hits
    it: the first query's batch runs while the next queries start.

    The structure changes in two cases only: a key put for the first time
    (the first start in this JVM), and a put that finds the map at its
    growth threshold (the growth check comes before the key is looked up,
    so the second start grows it). Growing the map well beyond its entries
    now, before any query of ours runs, leaves only the first start's new
    keys; :meth:`Pipeline.start` lets that start finish before the other
    queries begin. Where Spark has no such map (another version, Spark
    Connect), this does nothing.
    """
    try:
        source = (
            spark._jsparkSession.sessionState().dataSourceManager().lookupDataSource("headgate")
        )
        environment = source.dataSourceCls().envVars()
        if environment.containsKey(_SETTLED_MARK):
            return
        # A Scala or Java hash map never shrinks: 64 extra keys grow its table
        # to room for about 96, far above the dozen settings a start puts.
        fillers = [f"HEADGATE_SETTLING_{i}" for i in range(64)]
        for key in fillers:
            environment.put(key, "")
        for key in fillers:
            environment.remove(key)
        environment.put(_SETTLED_MARK, "1")
    except Exception:  # not the JVM this works around
        log.debug("no shared data source environment to settle", exc_info=True)


def _await_source_start(query: Any, timeout: float = 120.0) -> None:
    """Wait until ``query`` has created its source (its Python reader runs), or ended."""
    import time

    starting = ("Initializing StreamExecution", "Initializing sources")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and query.isActive:
        if query.status.get("message") not in starting:
            return
        time.sleep(0.05)


def query_name(stream: StreamPipeline) -> str:
    """The Spark query's name: one per stream and consumer (Spark refuses two alike at once).

    Two pipelines may read one stream in one SparkSession as two consumers.
    """
    if stream.consumer == DEFAULT_CONSUMER:
        return f"headgate_{stream.name}"
    return f"headgate_{stream.name}__{stream.consumer}"


@dataclass(frozen=True, slots=True)
class ConsumerProgress:
    """What a stream's last progress said of its consumer (the source's ``_consumer`` figures)."""

    #: The consumer the query reads for.
    consumer: str
    #: Log bytes between the end of the last planned batch and the durable end.
    lag_bytes: int
    #: Bytes skipped (freed before they were read) with fail_on_data_loss false.
    skipped_bytes: int
    #: Records in ``lag_bytes``; None where the source could not count them.
    lag_records: int | None = None
    #: Records in ``skipped_bytes``; None where the source could not count them.
    skipped_records: int | None = None


def consumer_progress(latest_offset: object) -> dict[str, ConsumerProgress]:
    """The consumer figures in a source progress's ``latestOffset``, by stream; {} if none."""
    from headgate.spark.source import PROGRESS_KEY

    try:
        parsed = json.loads(latest_offset) if isinstance(latest_offset, str) else latest_offset
    except ValueError:
        return {}
    figures = parsed.get(PROGRESS_KEY) if isinstance(parsed, dict) else None
    if not isinstance(figures, dict) or not isinstance(figures.get("lag_bytes"), dict):
        return {}
    skipped = figures.get("skipped_bytes")
    skipped = skipped if isinstance(skipped, dict) else {}

    def count(key: str, stream: object) -> int | None:
        table = figures.get(key)
        value = table.get(stream) if isinstance(table, dict) else None
        return value if isinstance(value, int) else None

    return {
        str(stream): ConsumerProgress(
            consumer=str(figures.get("name") or DEFAULT_CONSUMER),
            lag_bytes=int(lag),
            skipped_bytes=int(skipped.get(stream, 0)),
            lag_records=count("lag_records", stream),
            skipped_records=count("skipped_records", stream),
        )
        for stream, lag in figures["lag_bytes"].items()
        if isinstance(lag, int)
    }


class Pipeline:
    """Runs the configured queries and reports progress back as releases.

    Releases go to ``release`` if given, else to the configured gateway as
    Release messages, else nowhere.
    """

    def __init__(self, spark: Any, config: PipelineConfig, release: Release | None = None):
        self.spark = spark
        self.config = config
        self._gateway_releases: GatewayReleases | None = None
        if release is None and (config.gateway is not None or config.cluster is not None):
            self._gateway_releases = GatewayReleases(config)
            release = self._gateway_releases.release
        self._release = release
        self.queries: dict[str, Any] = {}
        self.rows_written: dict[str, int] = {s.name: 0 for s in config.streams}
        self.dead_letters: dict[str, int] = {s.name: 0 for s in config.streams}
        self.batches: dict[str, int] = {s.name: 0 for s in config.streams}
        self.committed: dict[str, int] = {}
        #: Per stream, its consumer's lag and skipped bytes at the last progress.
        self.consumer_progress: dict[str, ConsumerProgress] = {}
        self._lock = threading.Lock()
        self._listener: Any = None
        self._query_names = {query_name(s) for s in config.streams}
        self._plans: dict[str, _Plan] = {}
        self._available_now = False

    def start(self, *, available_now: bool = False) -> None:
        """Check every stream, then start one query per stream.

        ``available_now``: read what is there, then stop.

        Raises:
            ConfigError: a stream's schema, transform or partitioning is wrong,
                or its checkpoint was made for another definition.
        """
        from pyspark.sql.streaming.listener import StreamingQueryListener

        plans = check_pipeline(self.spark, self.config)
        check_definitions(self.config)
        pipeline = self
        # Py4J logs every error raised in a foreachBatch callback with its
        # whole traceback; the same error ends the query, whose exception
        # says it in one line (error_text), so the log is only noise.
        logging.getLogger("py4j.clientserver").setLevel(logging.CRITICAL)

        class _Progress(StreamingQueryListener):
            def onQueryStarted(self, event: Any) -> None:
                pass

            def onQueryProgress(self, event: Any) -> None:
                pipeline._on_progress(event.progress)

            def onQueryIdle(self, event: Any) -> None:
                pass

            def onQueryTerminated(self, event: Any) -> None:
                pass

        if self._gateway_releases is not None:
            # Each query's consumer holds the log from before its first batch.
            declare_consumers(self.config)
        self._listener = _Progress()
        self.spark.streams.addListener(self._listener)
        self._plans = plans
        self._available_now = available_now
        self._release_checkpoints()
        _settle_source_environment(self.spark)
        for index, stream in enumerate(self.config.streams):
            self.queries[stream.name] = self._start_query(plans[stream.name], available_now)
            if index == 0:
                # The first start in this JVM adds keys to the environment
                # that every batch serializes (see _settle_source_environment):
                # no other query may be in a batch meanwhile.
                _await_source_start(self.queries[stream.name])

    def restart_query(self, stream: str) -> None:
        """Start a stream's query again, from its checkpoint (after it failed)."""
        self.queries[stream] = self._start_query(self._plans[stream], self._available_now)

    def _release_checkpoints(self) -> None:
        """Release what each checkpoint records as committed, before any batch runs."""
        release_committed(self.config, self._release_once)

    def _release_once(self, stream: str, position: int) -> None:
        """Send a release unless one at or past ``position`` went out already."""
        with self._lock:
            if position <= self.committed.get(stream, -1):
                return
            self.committed[stream] = position
        if self._release is not None:
            try:
                self._release(stream, int(position))
            except Exception:  # never let it kill Spark's listener thread
                log.exception("releasing %s at %d failed", stream, position)

    def _on_progress(self, progress: Any) -> None:
        # Fires in the driver after the batch's commit, the last batch included,
        # for every query of the session: another pipeline's are not ours.
        if progress.name not in self._query_names:
            return
        for source in progress.sources:
            figures = consumer_progress(source.latestOffset)
            if figures:
                with self._lock:
                    self.consumer_progress.update(figures)
            end = source.endOffset
            if not end:
                continue
            offsets = json.loads(end) if isinstance(end, str) else end
            for stream, value in offsets.items():
                # An address inside a batch: that batch is not read yet.
                self._release_once(stream, offset_address(value).position)

    def _start_query(self, plan: _Plan, available_now: bool) -> Any:
        stream = plan.stream
        reader = (
            self.spark.readStream.format("headgate")
            .option("streams", stream.name)
            .option("missingStreams", self.config.missing_streams)
            .option("consumer", stream.consumer)
            .option("failOnDataLoss", "true" if stream.fail_on_data_loss else "false")
        )
        if self.config.cluster is not None:
            from headgate.spark.source import security_options

            reader = reader.option("cluster", str(self.config.cluster))
            for key, value in security_options(self.config.security).items():
                reader = reader.option(key, value)
        elif self.config.read_through_gateway:
            from headgate.spark.source import security_options

            reader = reader.option("gateway", self.config.gateway)
            for key, value in security_options(self.config.security).items():
                reader = reader.option(key, value)
        else:
            reader = reader.option("path", str(self.config.data_dir))
        if stream.max_records_per_trigger is not None:
            reader = reader.option("maxRecordsPerTrigger", stream.max_records_per_trigger)
        if stream.max_bytes_per_trigger is not None:
            reader = reader.option("maxBytesPerTrigger", stream.max_bytes_per_trigger)
        source = reader.load()
        output = self.config.output(stream.name)
        dead = self.config.dead_letters(stream.name)
        pipeline = self

        def write_batch(batch: Any, batch_id: int) -> None:
            with _short_jvm_errors():
                write(batch, batch_id)

        def write(batch: Any, batch_id: int) -> None:
            good, bad = _parse(plan, batch)
            good = _transform(plan, good).persist()
            rows = good.count()
            _commit_batch(good, output, batch_id, stream.partition_by)
            good.unpersist()
            bad_rows = 0
            if bad is not None:
                bad = bad.persist()
                bad_rows = bad.count()
                if bad_rows:
                    _commit_batch(bad, dead, batch_id, ())
                bad.unpersist()
            with pipeline._lock:
                pipeline.rows_written[stream.name] += rows
                pipeline.dead_letters[stream.name] += bad_rows
                pipeline.batches[stream.name] += 1

        writer = (
            source.writeStream.foreachBatch(write_batch)
            .option("checkpointLocation", str(self.config.checkpoint(stream.name)))
            .queryName(query_name(stream))
        )
        if available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{stream.trigger_seconds} seconds")
        return writer.start()

    def await_done(self, timeout: float | None = None) -> None:
        """Wait for availableNow queries to finish (or raise their failure)."""
        for query in self.queries.values():
            query.awaitTermination(timeout)
        self.drain_progress()

    def drain_progress(self, timeout_ms: int = 30_000) -> None:
        """Wait until Spark delivered every progress event, so the last release is out.

        Progress reaches the listener asynchronously, through Spark's listener
        bus; without this the final batch's release could be lost at shutdown.
        """
        bus = self.spark.sparkContext._jsc.sc().listenerBus()
        bus.waitUntilEmpty(timeout_ms)

    def catch_up(self) -> None:
        """Block until every running query has processed what is available now."""
        for query in self.queries.values():
            query.processAllAvailable()
        self.drain_progress()

    def stop(self, *, finish_batches: float = 0.0) -> None:
        """Stop the queries; every progress event (so every release) is out first.

        ``finish_batches``: wait up to this many seconds for each query's
        running micro-batch to end, rather than interrupt it (an interrupted
        batch is not lost: the next run does it again).
        """
        import time

        deadline = time.monotonic() + finish_batches
        for query in self.queries.values():
            while time.monotonic() < deadline and query.isActive:
                if not query.status.get("isTriggerActive"):
                    break
                time.sleep(0.1)
            query.stop()
        if self._listener is not None:
            # Removing the listener drops the events still on Spark's bus,
            # among them the last batch's release.
            self.drain_progress()
            self.spark.streams.removeListener(self._listener)
            self._listener = None
        if self._gateway_releases is not None:
            self._gateway_releases.close()
