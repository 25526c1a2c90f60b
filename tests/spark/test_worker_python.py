"""Spark's Python workers run the driver's interpreter when nothing says otherwise.

PySpark starts its workers with ``PYSPARK_PYTHON``, or else with the first
``python3`` on the PATH. A virtual environment's Python called by its path,
not activated (cron, systemd, Airflow), would start workers that cannot
import headgate, and ``format("headgate")`` would fail with
DATA_SOURCE_NOT_FOUND. The install puts ``headgate-pyspark-python.pth`` at
the top of site-packages (tests/test_packaging.py checks that a wheel and an
editable install do); it sets ``PYSPARK_PYTHON`` to the running interpreter.

Here a fresh virtual environment holds what an install puts there (that .pth
file, and the path of the headgate under test and of this environment's
libraries, as the editable install's own .pth does), and a script that knows
nothing of headgate makes its own SparkSession and reads ``format("headgate")``
with that environment's Python called by its path, under a PATH with no
virtual environment and no ``PYSPARK_PYTHON``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

import headgate
from headgate.log import StreamLog
from headgate.protocol.records import encode_records

REPO = Path(__file__).resolve().parents[2]
PTH = REPO / "src" / "headgate-pyspark-python.pth"

SCRIPT = """
import sys
from pyspark.sql import SparkSession

spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.ui.enabled", "false")
    .config("spark.ui.showConsoleProgress", "false")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")
rows = spark.read.format("headgate").option("path", sys.argv[1]).load().collect()
print("VALUES", sorted(bytes(r.value).decode() for r in rows))
spark.stop()
"""


def installed_like(tmp_path: Path, *, with_pth: bool) -> Path:
    """A virtual environment whose site-packages holds what ``pip install`` puts there."""
    home = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(home)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(home), "platbase": str(home)}))
    libraries = sysconfig.get_path("purelib")  # pyspark, pyarrow, ... of this environment
    under_test = Path(headgate.__file__).resolve().parents[1]
    (site / "libraries.pth").write_text(f"{under_test}\n{libraries}\n")
    if with_pth:
        shutil.copy(PTH, site / PTH.name)
    return home / "bin" / "python"


def bare_environment() -> dict[str, str]:
    """What cron or systemd give a command: no virtual environment, no PYSPARK_*."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    for kept in ("JAVA_HOME", "LANG", "TMPDIR"):
        if kept in os.environ:
            env[kept] = os.environ[kept]
    return env


def write_log(data_dir: Path) -> None:
    with StreamLog.open(data_dir / "streams" / "s", term_length=4096, capacity=1 << 16) as log:
        log.append(
            encode_records([b"one", b"two", b"three"], None),
            producer_id=1,
            first_sequence=0,
            record_count=3,
            timestamp_us=1_700_000_000_000_000,
        )
        log.sync()


def run_script(python: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [str(python), str(script), str(tmp_path / "data")],
        env=bare_environment(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.timeout(240)
def test_a_venv_python_called_by_path_reads_format_headgate(tmp_path: Path) -> None:
    write_log(tmp_path / "data")
    python = installed_like(tmp_path, with_pth=True)
    done = run_script(python, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "VALUES ['one', 'three', 'two']" in done.stdout
    # The same environment without the file is the reported failure: the
    # bare PATH does reproduce it (its python3 has no headgate).
    shutil.rmtree(tmp_path / "venv")
    python = installed_like(tmp_path, with_pth=False)
    failed = run_script(python, tmp_path)
    assert failed.returncode != 0 and "DATA_SOURCE_NOT_FOUND" in failed.stderr, failed.stderr[
        -3000:
    ]
