"""``headgate streams``: list, describe, and delete offline, against a real gateway."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from headgate.cli import main

from .serving import HEADGATE
from .serving import serve as _serve
from .serving import stop as _stop


@pytest.fixture
def data(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "data"


def test_streams_lists_describes_and_deletes_only_with_the_gateway_stopped(
    data: Path, tmp_path: Path
) -> None:
    runner = CliRunner()
    proc, address = _serve(data)
    try:
        for stream, count in (("alpha", 30), ("beta", 5)):
            source = tmp_path / f"{stream}.txt"
            source.write_text("".join(f"record {i}\n" for i in range(count)))
            sent = subprocess.run(
                [*HEADGATE, "send", stream, str(source), "--gateway", address],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert sent.returncode == 0, sent.stderr

        listed = runner.invoke(main, ["streams", "list", "--gateway", address])
        assert listed.exit_code == 0, listed.output
        lines = listed.output.splitlines()
        assert lines[0].split() == ["stream", "start", "durable", "tail", "retained"]
        assert [line.split()[0] for line in lines[1:]] == ["alpha", "beta"]

        as_json = runner.invoke(
            main, ["streams", "describe", "beta", "--gateway", address, "--format", "json"]
        )
        assert as_json.exit_code == 0, as_json.output
        (beta,) = [json.loads(line) for line in as_json.output.splitlines()]
        assert beta["stream"] == "beta" and beta["start_position"] == 0
        assert beta["durable_position"] == beta["tail_position"] > 0
        assert beta["retained_bytes"] == beta["tail_position"]

        unknown = runner.invoke(main, ["streams", "describe", "gamma", "--gateway", address])
        assert unknown.exit_code == 1
        assert (
            unknown.output == f"headgate streams: the gateway at {address} has no stream 'gamma'\n"
        )

        # The running gateway owns the directory: nothing is deleted under it.
        refused = runner.invoke(
            main, ["streams", "delete", "alpha", "--data-dir", str(data), "--yes"]
        )
        assert refused.exit_code == 1
        assert (
            "is in use by another gateway" in refused.output and "Traceback" not in refused.output
        )
        assert (data / "streams" / "alpha").is_dir()
    finally:
        _stop(proc)

    not_confirmed = runner.invoke(
        main, ["streams", "delete", "alpha", "--data-dir", str(data)], input="n\n"
    )
    assert not_confirmed.exit_code == 1 and (data / "streams" / "alpha").is_dir()
    deleted = runner.invoke(main, ["streams", "delete", "alpha", "--data-dir", str(data), "--yes"])
    assert deleted.exit_code == 0, deleted.output
    assert deleted.output.startswith("deleted stream 'alpha' (")
    assert not (data / "streams" / "alpha").exists()
    assert not (data / "state" / "alpha.producers.json").exists()
    assert not (data / "state" / "alpha.consumers.json").exists()
    assert (data / "state" / "beta.consumers.json").exists()
    again = runner.invoke(main, ["streams", "delete", "alpha", "--data-dir", str(data), "--yes"])
    assert again.exit_code == 1
    assert again.output == f"headgate streams: {data} holds no stream 'alpha'\n"

    # The gateway starts on what is left: beta only, with its records.
    proc, address = _serve(data)
    try:
        listed = runner.invoke(main, ["streams", "list", "--gateway", address, "--format", "json"])
        assert listed.exit_code == 0, listed.output
        rows = [json.loads(line) for line in listed.output.splitlines()]
        assert [row["stream"] for row in rows] == ["beta"]
        assert rows[0]["tail_position"] == beta["tail_position"]
    finally:
        _stop(proc)
