"""Build the optional C frame writer; install headgate's .pth file. Metadata: pyproject.toml.

The extension is optional: if it cannot be built (no compiler, no zlib
headers), the install still succeeds and headgate.log writes frames in pure
Python (see LOG.md, "The C frame writer").

``src/headgate-pyspark-python.pth`` goes to the top of site-packages, where
Python runs it at every start: it sets ``PYSPARK_PYTHON`` to the running
interpreter unless it is set already. PySpark starts its Python workers with
``PYSPARK_PYTHON``, or else with whatever ``python3`` comes first on the PATH;
a virtual environment's Python called by its path (cron, systemd, Airflow)
would otherwise start workers that cannot import headgate, and
``format("headgate")`` would fail with DATA_SOURCE_NOT_FOUND (README,
"Spark's Python workers").
"""

from __future__ import annotations

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

#: The file, under src/, that is installed at the top of site-packages.
PTH_FILE = "headgate-pyspark-python.pth"


class BuildPyWithPth(build_py):
    """build_py that also puts PTH_FILE at the top of the installed tree.

    A wheel installs what the build directory's top holds into site-packages.
    An editable install (PEP 660) builds nothing there: setuptools points the
    install command at the editable wheel's own top directory, so the file
    goes there.
    """

    def run(self) -> None:
        super().run()
        home = self._pth_home()
        self.mkpath(home)
        self.copy_file(os.path.join("src", PTH_FILE), os.path.join(home, PTH_FILE))

    def _pth_home(self) -> str:
        if self.editable_mode:
            return str(self.get_finalized_command("install").install_lib)
        return str(self.build_lib)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs.append(os.path.join(self.build_lib, PTH_FILE))
        return outputs


# Guarded so that tests can import the command class; builds run this file as __main__.
if __name__ == "__main__":
    setup(
        cmdclass={"build_py": BuildPyWithPth},
        ext_modules=[
            Extension(
                "headgate.log._frame_writer",
                sources=["src/headgate/log/_frame_writer.c"],
                libraries=["z"],
                extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
                optional=True,
            )
        ],
    )
