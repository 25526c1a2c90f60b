"""The files that run the gateway as a service: Dockerfile, compose.yaml, the systemd unit.

The fast tests read the files and check them against the command they start
(every flag must be one `headgate serve` takes). The image builds are marked
``docker``: they take minutes and need a Docker daemon that can pull
python:3.11-slim, so the default run leaves them out. Run them with
``pytest -m docker tests/test_deploy.py``; where ``docker info`` fails they skip,
saying why.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from headgate.cli import main

REPO = Path(__file__).resolve().parents[1]


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def _stages(dockerfile: str) -> dict[str, list[tuple[str, str]]]:
    """The instructions of each named stage, in order; the last one is the default target."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for keyword, rest in _instructions(dockerfile):
        if keyword == "FROM":
            name = rest.split(" AS ")[-1].strip() if " AS " in rest else rest
            current = stages.setdefault(name, [])
        if current is not None:
            current.append((keyword, rest))
    return stages


def _exec_form(arguments: str) -> list[str]:
    words = re.findall(r'"((?:[^"\\]|\\.)*)"', arguments)
    assert arguments.startswith("[") and words, arguments
    return words


def _serve_accepts(args: list[str]) -> None:
    """Fail unless ``headgate serve`` parses ``args`` (only parses: nothing starts)."""
    serve = main.get_command(click.Context(main), "serve")
    assert serve is not None
    try:
        serve.make_context("serve", list(args))
    except click.UsageError as exc:
        raise AssertionError(f"headgate serve {shlex.join(args)}: {exc.format_message()}") from exc


DOCKERFILE = (REPO / "Dockerfile").read_text(encoding="utf-8")


def test_the_default_image_is_the_gateway_without_spark_as_an_unprivileged_user() -> None:
    stages = _stages(DOCKERFILE)
    assert list(stages)[-1] == "gateway"  # what a plain `docker build .` makes
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in DOCKERFILE
    gateway = stages["gateway"]
    installs = [rest for keyword, rest in gateway if keyword == "RUN" and "pip install" in rest]
    assert len(installs) == 1 and "[spark]" not in installs[0]
    assert "-c /tmp/constraints.txt" in installs[0]
    users = [rest for keyword, rest in gateway if keyword == "USER"]
    assert users == ["headgate"]
    assert ("VOLUME", "/data") in gateway
    exposed = {port for keyword, rest in gateway if keyword == "EXPOSE" for port in rest.split()}
    assert "7878" in exposed
    assert any(keyword == "HEALTHCHECK" for keyword, _ in gateway)
    assert ("ENV", "HEADGATE_LOG_FORMAT=json") in gateway  # a container's log is collected
    entrypoint = next(_exec_form(rest) for keyword, rest in gateway if keyword == "ENTRYPOINT")
    command = next(_exec_form(rest) for keyword, rest in gateway if keyword == "CMD")
    assert entrypoint == ["headgate", "serve"]
    assert command[command.index("--listen") + 1] == "0.0.0.0:7878"
    assert command[command.index("--data-dir") + 1] == "/data"
    _serve_accepts(command)
    # The health check asks the metrics endpoint that the command turns on.
    metrics_port = command[command.index("--metrics") + 1].rsplit(":", 1)[1]
    healthcheck = next(rest for keyword, rest in gateway if keyword == "HEALTHCHECK")
    assert f"127.0.0.1:{metrics_port}/metrics" in healthcheck


def test_the_pipeline_image_adds_spark_and_java_for_the_same_user() -> None:
    stages = _stages(DOCKERFILE)
    pipeline = stages["pipeline"]
    runs = " ".join(rest for keyword, rest in pipeline if keyword == "RUN")
    assert "[spark]" in runs and "jre" in runs
    assert [rest for keyword, rest in pipeline if keyword == "USER"] == ["headgate"]
    base = " ".join(rest for keyword, rest in stages["base"] if keyword == "RUN")
    assert "useradd" in base and "--uid 10001" in base  # one uid: both write /data


def test_what_the_dockerfile_copies_is_in_the_build_context() -> None:
    ignore = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for keyword, rest in _instructions(DOCKERFILE):
        if keyword != "COPY" or rest.startswith("--from"):
            continue
        *sources, _destination = rest.split()
        for source in sources:
            assert (REPO / source).exists(), source
            assert source.rstrip("/") in allowed, f".dockerignore leaves out {source}"


def test_compose_runs_both_targets_on_one_volume_with_a_pipeline_file_that_loads() -> None:
    from headgate.spark.pipeline import load_pipeline_config

    compose = (REPO / "compose.yaml").read_text(encoding="utf-8")
    assert re.search(r"^  gateway:\n(    .*\n)*?      target: gateway$", compose, re.MULTILINE)
    assert re.search(r"^  pipeline:\n(    .*\n)*?      target: pipeline$", compose, re.MULTILINE)
    assert compose.count("- data:/data") == 2
    assert "condition: service_healthy" in compose
    mount = re.search(r"- \./(\S+):/etc/headgate/pipeline\.toml:ro", compose)
    assert mount is not None
    stages = _stages(DOCKERFILE)
    command = next(_exec_form(rest) for keyword, rest in stages["pipeline"] if keyword == "CMD")
    assert command == ["/etc/headgate/pipeline.toml"]
    config = load_pipeline_config(REPO / mount[1])
    assert str(config.data_dir) == "/data"
    assert config.streams


SERVICE = (REPO / "examples" / "headgate.service").read_text(encoding="utf-8")


def test_the_systemd_unit_starts_serve_with_flags_it_takes() -> None:
    joined = SERVICE.replace("\\\n", " ")
    exec_start = next(line for line in joined.splitlines() if line.startswith("ExecStart="))
    words = shlex.split(exec_start.removeprefix("ExecStart="))
    assert words[0].endswith("/bin/headgate") and words[1] == "serve"
    _serve_accepts(words[2:])
    assert "ExecReload=/bin/kill -HUP $MAINPID" in SERVICE  # serve reloads its config on SIGHUP


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at one that does.
    unit = tmp_path / "headgate.service"
    unit.write_text(
        SERVICE.replace("/opt/headgate/bin/headgate", shutil.which("true") or "/bin/true")
    )
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "headgate.service" not in done.stderr, done.stderr  # warnings about our unit


# -- building the images (pytest -m docker) ------------------------------------------


@pytest.fixture
def docker() -> Iterator[str]:
    """A tag to build under, removed afterwards; skips where Docker cannot build."""
    if shutil.which("docker") is None:
        pytest.skip("no docker command on this machine")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        reason = (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        pytest.skip(f"Docker cannot build here: {reason}")
    tag = f"headgate-test-{uuid.uuid4().hex[:8]}"
    try:
        yield tag
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=120)


def _build(tag: str, target: str) -> None:
    done = subprocess.run(
        ["docker", "build", "--target", target, "-t", tag, str(REPO)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _in_image(tag: str, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", command[0], tag, *command[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.docker
@pytest.mark.timeout(1800)
def test_the_gateway_image_builds_and_runs_without_spark_and_without_root(docker: str) -> None:
    _build(docker, "gateway")
    version = _in_image(docker, "headgate", "--version")
    assert version.returncode == 0 and version.stdout.startswith("headgate "), version
    assert _in_image(docker, "id", "-u").stdout.strip() == "10001"
    spark = _in_image(docker, "python", "-c", "import pyspark")
    assert spark.returncode != 0 and "pyspark" in spark.stderr
    query = _in_image(docker, "headgate", "query", "SELECT 1")
    assert query.returncode == 1 and "pip install 'headgate[spark]'" in query.stderr


@pytest.mark.docker
@pytest.mark.timeout(1800)
def test_the_pipeline_image_builds_with_spark_and_java(docker: str) -> None:
    _build(docker, "pipeline")
    java = _in_image(docker, "java", "-version")
    assert java.returncode == 0, java.stderr
    spark = _in_image(docker, "python", "-c", "import pyspark, pandas, headgate.spark")
    assert spark.returncode == 0, spark.stderr
