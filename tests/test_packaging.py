"""What `pip install headgate` gives without Spark, and what `headgate[spark]` adds."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.extras import SPARK_EXTRA, SPARK_MODULES

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))

#: What the Spark commands import after their check; absent, so that a command
#: that skipped the check fails here instead of starting Spark (or the demo's gateway).
_LAZY_SPARK_IMPORTS = (
    "headgate.cli.demo",
    "headgate.spark",
    "headgate.spark.command",
    "headgate.spark.pipeline",
    "headgate.spark.query",
    "headgate.spark.source",
)


def _requirement_name(requirement: str) -> str:
    name = requirement.split(";")[0]
    for cut in "<>=!~[ ":
        name = name.split(cut)[0]
    return name.strip().lower()


@pytest.fixture
def without_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like `pip install headgate` without the spark extra."""
    for module in (*SPARK_MODULES, "pyspark.sql", *_LAZY_SPARK_IMPORTS):
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize(
    "args",
    [
        ["query", "SELECT 1"],
        ["pipeline", "examples/pipeline.toml"],
        ["run", "--seconds", "1"],
    ],
    ids=lambda args: args[0],
)
def test_a_spark_command_without_spark_names_the_extra_in_one_line(
    without_spark: None, args: list[str], tmp_path: Path
) -> None:
    if args[0] == "run":
        args = [*args, "--data-dir", str(tmp_path / "demo")]
    result = CliRunner().invoke(main, args)
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"headgate {args[0]}: ")
    assert "pip install 'headgate[spark]'" in lines[0]
    assert "pyspark" in lines[0]
    assert "Traceback" not in result.output
    assert not (tmp_path / "demo").exists()  # nothing started


def test_the_spark_extra_brings_the_modules_the_check_asks_for() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {_requirement_name(r) for r in extras[SPARK_EXTRA]} == set(SPARK_MODULES)


def test_the_core_dependencies_leave_spark_out_and_are_ranges_not_pins() -> None:
    project = PYPROJECT["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    assert core.isdisjoint({"pyspark", "pandas", "py4j"}), core
    every = [*project["dependencies"]]
    for requirements in project["optional-dependencies"].values():
        every += requirements
    versions = [r.split(";")[0] for r in every]  # markers may say ==
    assert [v for v in versions if "==" in v] == [], "exact versions belong in constraints.txt"
    assert [v for v in versions if "<" not in v] == [], "a range needs an upper bound"


def test_the_constraints_pin_every_requirement_the_makefile_installs() -> None:
    pins: dict[str, str] = {}
    for line in (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: not an exact pin: {line!r}"
            pins[name.strip().lower().replace("_", "-")] = version
    assert "headgate" not in pins
    project = PYPROJECT["project"]
    requirements = [*project["dependencies"]]
    for requirements_of_extra in project["optional-dependencies"].values():
        requirements += requirements_of_extra
    names = {_requirement_name(r).replace("_", "-") for r in requirements}
    assert names - set(pins) == set(), "a requirement without a pin in constraints.txt"
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert "-c constraints.txt" in makefile
    assert "spark]" in makefile  # make run needs Spark
    stamp_rule = next(line for line in makefile.splitlines() if line.startswith("$(STAMP):"))
    assert "constraints.txt" in stamp_rule


def test_the_producer_the_gateway_and_serve_help_do_not_import_spark() -> None:
    script = (
        "import sys\n"
        "import headgate, headgate.client, headgate.gateway, headgate.cli\n"
        "from click.testing import CliRunner\n"
        "result = CliRunner().invoke(headgate.cli.main, ['serve', '--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "assert '--data-dir' in result.output\n"
        "loaded = sorted(m for m in ('pyspark', 'pandas', 'py4j') if m in sys.modules)\n"
        "assert loaded == [], loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr


def test_the_pypi_description_starts_with_pip_install_and_the_readme_with_make() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (REPO / "LICENSE").read_text(encoding="utf-8")[:200]
    description = (REPO / project["readme"]).read_text(encoding="utf-8").splitlines()
    assert description[0] == "```sh"
    assert description[1].startswith("pip install headgate ")
    assert description[2].startswith("pip install 'headgate[spark]' ")
    # README.md stays the developer's page: its first lines are the two make commands.
    readme = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert readme[0] == "```sh"
    assert [line.split()[:2] for line in readme[1:3]] == [["make", "run"], ["make", "test"]]


def _setup_module() -> Any:
    """setup.py as a module (its setup() call runs only as __main__, as builds run it)."""
    spec = importlib.util.spec_from_file_location("headgate_setup", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:setup.py install is deprecated")
def test_the_build_puts_the_pyspark_python_file_at_the_top_of_site_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel installs its build directory's top into site-packages; an editable
    install (``make setup``) writes its top level through the install command."""
    from setuptools import Distribution  # type: ignore[import-untyped]

    setup_module = _setup_module()
    build_py_class = setup_module.BuildPyWithPth
    pth = REPO / "src" / setup_module.PTH_FILE
    monkeypatch.chdir(REPO)
    for editable in (False, True):
        dist = Distribution({"name": "headgate", "cmdclass": {"build_py": build_py_class}})
        top = tmp_path / ("editable" if editable else "wheel")
        if editable:
            install = dist.get_command_obj("install")
            install.install_lib = str(top)  # what setuptools' editable_wheel does
        command = dist.get_command_obj("build_py")
        command.build_lib = str(tmp_path / "build-lib" if editable else top)
        command.editable_mode = editable
        command.ensure_finalized()
        command.run()
        assert (top / pth.name).read_bytes() == pth.read_bytes(), editable
        assert (str(top / pth.name) in command.get_outputs()) is not editable
    assert "include src/headgate-pyspark-python.pth" in (REPO / "MANIFEST.in").read_text()


def test_the_pyspark_python_file_sets_the_interpreter_unless_it_is_set(tmp_path: Path) -> None:
    shutil.copy(REPO / "src" / "headgate-pyspark-python.pth", tmp_path)
    show = (
        f"import site; site.addsitedir({str(tmp_path)!r}); "
        "import os; print(os.environ.get('PYSPARK_PYTHON'))"
    )
    bare = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    for extra, expected in (({}, sys.executable), ({"PYSPARK_PYTHON": "/opt/py"}, "/opt/py")):
        shown = subprocess.run(
            [sys.executable, "-S", "-c", show],
            env={**bare, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.stdout.strip() == expected, shown.stderr
