"""``headgate pipeline``: every mistake in the file is named plainly, before Spark starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import headgate.spark.command
from headgate.cli import main
from headgate.config import ConfigError
from headgate.spark.pipeline import (
    PipelineConfig,
    load_pipeline_config,
    pipeline_config_from_dict,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pipeline.toml"

GOOD_STREAM = '[streams.ticks]\nformat = "json"\nschema = "a INT"\n'


@pytest.fixture(autouse=True)
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("a mistake in the file must be found without starting Spark")

    monkeypatch.setattr(headgate.spark.command, "spark_session", refuse)


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        ("", ["needs at least one [streams.NAME]"]),
        ("bogus = 1\n" + GOOD_STREAM, ["unknown key(s) bogus", "known: data_dir"]),
        ("[streams.a]\nsink = 'x'\n", ["streams.a: unknown key(s) sink", "known:"]),
        ("[streams.a]\nformat = 'xml'\n", ["streams.a.format must be one of json, csv, raw"]),
        ("[streams.a]\nformat = 'csv'\n", ["streams.a: format csv needs a DDL schema"]),
        ("[streams.a]\nschema = 'a INT'\n", ["streams.a.schema: format raw is not parsed"]),
        ("[streams.a]\noutput = ''\n", ["streams.a.output must be a non-empty path"]),
        ("[streams.a]\ncheckpoint = 3\n", ["streams.a.checkpoint must be a non-empty path"]),
        ("[streams.a]\ntrigger_seconds = -1\n", ["streams.a.trigger_seconds must be a positive"]),
        ("[streams.a]\nmax_records_per_trigger = 0\n", ["max_records_per_trigger must be a pos"]),
        (
            "[streams.a]\nmax_bytes_per_trigger = 'lots'\n",
            ["max_bytes_per_trigger: expected a size"],
        ),
        ("[streams.a]\npartition_by = 'x'\n", ["streams.a.partition_by must be a list"]),
        ("[streams.a]\ntransform = 5\n", ["streams.a.transform must be SQL text"]),
        (
            "[streams.a]\nformat = 'csv'\nschema = 'a INT'\noptions = { separator = ';' }\n",
            ["streams.a.options.separator: not a csv parser option", "known: "],
        ),
        (
            "[streams.a]\nformat = 'json'\nschema = 'a INT'\noptions = { mode = 'FAILFAST' }\n",
            ["streams.a.options.mode: not a json parser option"],
        ),
        ("[streams.'bad name']\n", ["'bad name' is not a stream name"]),
        ("[streams]\na = 1\n", ["streams.a must be a table"]),
        ("gateway = 'unix:'\n" + GOOD_STREAM, ["gateway: 'unix:' names no socket path"]),
        ("gateway = 'h:http'\n" + GOOD_STREAM, ["gateway: port must be a number"]),
        ("read_through_gateway = true\n" + GOOD_STREAM, ["needs a gateway address"]),
        (
            "[streams.a]\noutput = 'same'\n[streams.b]\noutput = 'same'\n",
            ["streams.b and streams.a share the output directory"],
        ),
        ("[streams.a\n", ["not valid TOML"]),
        ("missing_streams = 'later'\n" + GOOD_STREAM, ["missing_streams must be 'fail' or 'wait'"]),
        ("missing_streams = true\n" + GOOD_STREAM, ["missing_streams must be 'fail' or 'wait'"]),
        ("[streams.a]\nconsumer = 'a b'\n", ["streams.a.consumer: 'a b' is not a consumer"]),
        ("[streams.a]\nblocking = 'no'\n", ["streams.a.blocking must be true or false"]),
        (
            "[streams.a]\nfail_on_data_loss = 1\n",
            ["streams.a.fail_on_data_loss must be true or false"],
        ),
    ],
)
def test_a_bad_file_is_refused_with_its_name_and_key(
    tmp_path: Path, body: str, fragments: list[str]
) -> None:
    path = tmp_path / "p.toml"
    path.write_text(body)
    result = CliRunner().invoke(main, ["pipeline", str(path), "--available-now"])
    assert result.exit_code == 2, result.output
    assert str(path) in result.output
    for fragment in fragments:
        assert fragment in result.output, result.output
    assert "Traceback" not in result.output


def test_a_missing_file_or_data_directory_is_named(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["pipeline", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2
    assert "nope.toml does not exist" in result.output
    path = tmp_path / "p.toml"
    path.write_text(f"data_dir = '{tmp_path / 'nodata'}'\n" + GOOD_STREAM)
    result = CliRunner().invoke(main, ["pipeline", str(path)])
    assert result.exit_code == 2
    assert "data_dir" in result.output and "nodata does not exist" in result.output
    assert "Traceback" not in result.output


def test_the_example_file_is_valid_and_the_help_shows_an_example() -> None:
    config = load_pipeline_config(EXAMPLE)
    assert [s.name for s in config.streams] == ["ticks", "accounting", "audit"]
    ticks = config.stream("ticks")
    assert ticks.partition_by == ("symbol",) and ticks.max_bytes_per_trigger == 16 * 1024**2
    assert dict(config.stream("accounting").options) == {"sep": ";", "nullValue": "-"}
    assert config.gateway == "127.0.0.1:7878"
    # It is started before its producers (README): it waits for its streams.
    assert config.missing_streams == "wait"
    assert load_pipeline_config(EXAMPLE.with_name("compose") / "pipeline.toml").missing_streams == (
        "wait"
    )
    assert config.output("ticks") == Path("headgate-data/parquet/ticks")
    assert config.checkpoint("audit") == Path("headgate-data/checkpoints/audit")
    result = CliRunner().invoke(main, ["pipeline", "--help"])
    assert result.exit_code == 0
    assert "--available-now" in result.output and "[streams.ticks]" in result.output


def test_options_become_text_and_outputs_can_move(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        "[streams.a]\nformat = 'csv'\nschema = 'a INT'\noutput = 'out/a'\n"
        "checkpoint = 'cp/a'\noptions = { ignoreLeadingWhiteSpace = true, maxCharsPerColumn = 9 }\n"
    )
    config = load_pipeline_config(path)
    assert dict(config.stream("a").options) == {
        "ignoreLeadingWhiteSpace": "true",
        "maxCharsPerColumn": "9",
    }
    assert config.output("a") == Path("out/a") and config.checkpoint("a") == Path("cp/a")
    with pytest.raises(ConfigError, match="is a directory"):
        load_pipeline_config(tmp_path)


def test_each_stream_releases_as_a_consumer_named_after_the_file_unless_it_names_one(
    tmp_path: Path,
) -> None:
    archive, live = tmp_path / "archive.toml", tmp_path / "live.toml"
    body = "[streams.a]\n[streams.b]\nconsumer = 'backfill'\nblocking = false\n"
    archive.write_text(body + "fail_on_data_loss = false\n")
    live.write_text(body)
    config = load_pipeline_config(archive)
    assert config.stream("a").consumer == "archive"  # two files never share one by accident
    assert load_pipeline_config(live).stream("a").consumer == "live"
    b = config.stream("b")
    assert (b.consumer, b.blocking, b.fail_on_data_loss) == ("backfill", False, False)
    assert (config.stream("a").blocking, config.stream("a").fail_on_data_loss) == (True, True)
    # A file whose name is no consumer name must say which consumer to use.
    odd = tmp_path / "my pipeline.toml"
    odd.write_text("[streams.a]\n")
    with pytest.raises(ConfigError, match=r"streams.a: the pipeline file's name is not a consumer"):
        load_pipeline_config(odd)
    odd.write_text("[streams.a]\nconsumer = 'mine'\n")
    assert load_pipeline_config(odd).stream("a").consumer == "mine"
    # Built from a dict (headgate run's own pipeline): the stream's implicit consumer.
    assert pipeline_config_from_dict({"streams": {"a": {}}}).stream("a").consumer == "default"


def test_a_token_that_may_not_declare_the_consumer_is_an_error_before_spark_starts(
    tmp_path: Path,
) -> None:
    from headgate.cli.demo import BackgroundLoop
    from headgate.client import ClientSecurity, Producer
    from headgate.config import GatewayConfig
    from headgate.gateway import Gateway
    from tests.gateway._tokens import Token, write_tokens

    tokens = write_tokens(
        tmp_path / "tokens.toml",
        Token("ingest", "w" * 32, write=("*",)),
        Token("archiver", "c" * 32, read=("*",), consume=("s/archive",)),
    )
    data = tmp_path / "data"
    loop = BackgroundLoop("test-gateway")
    gateway = Gateway(GatewayConfig(listen=("127.0.0.1", 0), data_dir=data, auth_file=tokens))
    loop.run(gateway.start(), 30)
    try:
        host, port = gateway.address
        address = f"{host}:{port}"

        async def produce() -> None:
            async with Producer(address, security=ClientSecurity(token=b"w" * 32)) as producer:
                await producer.send("s", b"one")
                await producer.flush()

        loop.run(produce(), 30)
        (tmp_path / "token").write_text("c" * 32)
        path = tmp_path / "live.toml"  # its consumer would be "live": not the token's
        path.write_text(
            f"data_dir = '{data}'\ngateway = '{address}'\ntoken_file = '{tmp_path / 'token'}'\n"
            "[streams.s]\n"
        )
        result = CliRunner().invoke(main, ["pipeline", str(path), "--available-now"])
        assert result.exit_code == 2, result.output
        refusal = f"{path}: streams.s: the gateway at {address} refused to declare consumer 'live'"
        assert refusal in result.output, result.output
        assert "a consume pattern matching s/live" in result.output
        assert "Traceback" not in result.output
        consumers = loop.run(_consumers(gateway), 10)
        assert consumers == {"default"}, "nothing was declared"
    finally:
        loop.run(gateway.stop(), 30)
        loop.stop()


async def _consumers(gateway: Any) -> set[str]:
    return set(gateway.streams["s"].consumers.consumers)


def test_spark_errors_are_cut_to_the_line_that_says_what_went_wrong() -> None:
    from headgate.spark.pipeline import error_text

    wrapped = Exception(
        "[PYTHON_DATA_SOURCE_ERROR] Failed to create Python data source instance: "
        'Traceback (most recent call last):\n  File "source.py", line 171, in parse\n'
        "    raise ValueError(NOT_YET)\nValueError: headgate: not available yet\n SQLSTATE: 38000"
    )
    assert error_text(wrapped) == "headgate: not available yet"
    parse = Exception("\n[PARSE_SYNTAX_ERROR] Syntax error at or near 'b'. SQLSTATE: 42601")
    assert error_text(parse) == "[PARSE_SYNTAX_ERROR] Syntax error at or near 'b'."
    assert error_text(Exception("")) == "Exception"


def test_a_checkpoint_is_refused_for_another_definition_of_its_query(tmp_path: Path) -> None:
    from headgate.spark.pipeline import (
        DEFINITION_FILE,
        check_definitions,
        pipeline_config_from_dict,
    )

    def config(**audit: object) -> PipelineConfig:
        stream = {"format": "json", "schema": "user STRING, action STRING", **audit}
        return pipeline_config_from_dict(
            {"data_dir": str(tmp_path), "streams": {"audit": stream}}, where="p.toml"
        )

    first = config(max_records_per_trigger=10)
    check_definitions(first)
    record = first.checkpoint("audit") / DEFINITION_FILE
    assert record.exists()
    # The same definition resumes; so do new read limits and a new trigger.
    check_definitions(config(max_records_per_trigger=99, trigger_seconds=5.0))
    # Another format or schema would write rows of another shape into the dataset.
    with pytest.raises(ConfigError) as refused:
        check_definitions(config(format="csv", schema="user STRING"))
    text = str(refused.value)
    assert text.startswith("p.toml: stream 'audit'")
    assert "format, schema changed" in text
    assert f"delete {first.checkpoint('audit')} and {first.output('audit')}" in text
    with pytest.raises(ConfigError, match="transform changed"):
        check_definitions(config(transform="SELECT user FROM audit"))
    with pytest.raises(ConfigError, match="output changed"):
        check_definitions(config(output=str(tmp_path / "elsewhere")))
    # Refusing changed nothing: the original definition still resumes.
    check_definitions(first)
    # A checkpoint of a headgate whose rows had no index column (issue 14)
    # would mix two shapes in one dataset: refused, saying so.
    older = json.loads(record.read_text())
    del older["columns"]
    record.write_text(json.dumps(older))
    with pytest.raises(ConfigError) as before_index:
        check_definitions(first)
    assert (
        "(columns changed; rows now carry stream, position, index, producer, sequence, "
        "ingest_time). To start over, delete"
    ) in str(before_index.value)
    # So is a checkpoint that Spark used under a headgate that recorded no definition.
    record.unlink()
    (first.checkpoint("audit") / "offsets").mkdir()
    (first.checkpoint("audit") / "offsets" / "0").write_text("v1\n{}\n{}\n")
    with pytest.raises(ConfigError, match=r"was made by an older headgate, whose rows lacked"):
        check_definitions(first)
    assert not record.exists()
    check_definitions(config(output=str(tmp_path / "new-out"), checkpoint=str(tmp_path / "ck")))
    with pytest.raises(ConfigError, match=r"older headgate"):
        check_definitions(first, write_new=False)  # the check before Spark's analyser, too
    # A record that is not JSON is named, not a traceback.
    record.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        check_definitions(first)
