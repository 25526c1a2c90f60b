"""Run a target under atheris (libFuzzer, coverage-guided); shared by the entry points."""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from headgate.protocol.errors import ProtocolError

ROOT = Path(__file__).resolve().parents[2]


def _launcher(module: str) -> str:
    # libFuzzer's -merge and -fork modes run argv[0] again as a program; a
    # module run with -m is not one, so hand it a script that is.
    path = os.path.join(tempfile.gettempdir(), f"headgate-fuzz-{module}-{os.getuid()}.sh")
    with open(path, "w") as script:
        script.write(
            f"#!/bin/sh\ncd {shlex.quote(str(ROOT))} && "
            f'exec {shlex.quote(sys.executable)} -m {module} "$@"\n'
        )
    os.chmod(path, 0o700)
    return path


def run(target: Callable[[bytes], None], module: str) -> None:
    """``python -m tests.fuzz.fuzz_X [libFuzzer flags] [corpus dirs]``."""
    import atheris

    def one_input(data: bytes) -> None:
        try:
            target(data)
        except ProtocolError:
            # The targets handle these themselves; one escaping is a bug in
            # the target, not a finding, but it must not hide as a pass.
            raise AssertionError("a ProtocolError escaped the target") from None

    argv = list(sys.argv)
    if any(arg.startswith(("-merge=", "-fork=", "-set_cover_merge=")) for arg in argv[1:]):
        argv[0] = _launcher(module)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()
