"""The pipeline's TOML file: its keys, their checks, and the configuration they make.

Each ``[streams.NAME]`` table describes how one stream's values are parsed
(JSON with a DDL schema, CSV with a DDL schema, or raw bytes), an optional
SQL transform over a view named after the stream, and a Parquet sink
(:mod:`headgate.spark.transform` does that work; :mod:`headgate.spark.pipeline`
runs the queries).

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
gateway before any query starts
(:func:`~headgate.spark.releases.declare_consumers`; its token needs
``admin`` or a ``consume`` pattern matching ``STREAM/CONSUMER``). A
configuration built from a dict, as ``headgate run`` builds its own, releases
as ``default``, the consumer a stream has when nobody declared one.

Every structural mistake is found by :func:`load_pipeline_config` without
Spark; schemas, transforms and partition columns are checked by Spark's
analyser over an empty frame (:func:`~headgate.spark.transform.check_pipeline`)
before any query starts. Both raise :class:`~headgate.config.ConfigError`
naming the file and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headgate.client.security import ClientSecurity, SecurityError
from headgate.config import ConfigError, parse_size
from headgate.protocol.messages import DEFAULT_CONSUMER, is_valid_name
from headgate.spark.planning import MISSING_STREAMS
from headgate.tomlfile import expect_table, read_toml, refuse_unknown

__all__ = [
    "FLEET_META_COLUMNS",
    "FORMATS",
    "META_COLUMNS",
    "PARSER_OPTIONS",
    "PipelineConfig",
    "StreamPipeline",
    "load_pipeline_config",
    "meta_columns",
    "pipeline_config_from_dict",
]


FORMATS = ("json", "csv", "raw")


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


def meta_columns(config: PipelineConfig) -> tuple[str, ...]:
    """The record's columns the pipeline adds to each output row (``partition`` for a fleet)."""
    return FLEET_META_COLUMNS if config.cluster is not None else META_COLUMNS


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
