"""The Spark source and the pipeline through a gateway with TLS and tokens.

The token reaches the driver and the executors as the path of a file
(``tokenFile`` / ``token_file``), never as an option value, so it appears in
no plan, offset or partition description.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from headgate.client.security import ClientSecurity
from headgate.spark.pipeline import Pipeline, pipeline_config_from_dict
from headgate.spark.source import HeadgatePartition, SourceOptions, security_options
from tests.client.test_secure_clients import ADMIN, READER, Secured

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    served = Secured(tmp_path_factory.mktemp("secured-spark"))
    try:
        served.produce("open-s", 500)
        yield served
    finally:
        served.stop()


def test_security_options_are_checked_and_kept_out_of_repr(tmp_path: Path) -> None:
    parsed = SourceOptions.parse(
        {"gateway": "127.0.0.1:1", "TOKENENV": "HG_T", "tlsCaFile": "ca.pem", "tls": "true"}
    )
    assert parsed.security == ClientSecurity(token_env="HG_T", tls=True, ca_file="ca.pem")
    assert security_options(parsed.security) == {
        "tokenEnv": "HG_T",
        "tls": "true",
        "tlsCaFile": "ca.pem",
    }
    plain = SourceOptions.parse({"gateway": "127.0.0.1:1", "token": "s3cr3t-token"})
    partition = HeadgatePartition((), None, "127.0.0.1:1", plain.security)
    assert "s3cr3t" not in repr(partition)
    assert pickle.loads(pickle.dumps(partition)).security.token_bytes() == b"s3cr3t-token"
    for options, fragment in (
        ({"path": str(tmp_path), "tokenEnv": "X"}, "'tokenEnv' needs option 'gateway'"),
        ({"gateway": "h:1", "tls": "yes"}, "'tls' must be true or false"),
        ({"gateway": "h:1", "tokenEnv": "A", "tokenFile": "f"}, "tokenEnv and tokenFile"),
        ({"gateway": "h:1", "tlsKeyFile": "k"}, "needs its certificate \\(tlsCertFile\\)"),
        ({"gateway": "h:1", "tlsCaFile": " "}, "'tlsCaFile' is empty"),
    ):
        with pytest.raises(ValueError, match=fragment):
            SourceOptions.parse(options)


def test_spark_reads_and_the_pipeline_releases_through_a_tls_gateway_with_tokens(
    spark: SparkSession, secured: Secured, tmp_path: Path
) -> None:
    reader_token = tmp_path / "reader.token"
    reader_token.write_text(READER + "\n")
    frame = (
        spark.read.format("headgate")
        .option("gateway", secured.address)
        .option("tokenFile", str(reader_token))
        .option("tlsCaFile", str(secured.pki.ca))
        .option("bytesPerPartition", 4096)
        .load()
    )
    assert frame.rdd.getNumPartitions() > 1  # the executors connect too
    values = sorted(r.value for r in frame.select("value").collect())
    assert values == [b"open-s-%05d" % i for i in range(500)]

    admin_token = tmp_path / "admin.token"
    admin_token.write_text(ADMIN)
    out = tmp_path / "out"
    pipeline = Pipeline(
        spark,
        pipeline_config_from_dict(
            {
                "data_dir": str(tmp_path / "nowhere"),
                "gateway": secured.address,
                "read_through_gateway": True,
                "token_file": str(admin_token),
                "tls_ca_file": str(secured.pki.ca),
                "output_dir": str(out),
                "checkpoint_dir": str(tmp_path / "checkpoints"),
                "streams": {"open-s": {}},
            }
        ),
    )
    try:
        pipeline.start(available_now=True)
        pipeline.await_done(120)
    finally:
        pipeline.stop()
    assert len(pq.read_table(out / "open-s").to_pydict()["value"]) == 500
    log = secured.log("open-s")
    deadline = time.monotonic() + 10
    while log.release_position < log.durable_position and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.release_position == log.durable_position
