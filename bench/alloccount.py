"""Count allocator calls in a Python process: an instrument for the benchmarks.

``tracemalloc`` hooks CPython's allocators (PEP 445) and records the blocks
that are *live*, with their tracebacks; it keeps no count of allocation
events, so "allocations per record" cannot be read from it. ``_alloc_hook.c``
(next to this file) installs a hook the same way and counts every malloc,
calloc and realloc, in all three domains, with the bytes asked for. It is
compiled on first use with the C compiler Python was built with, into a cache
directory, and is never part of the package.

In a process::

    hook = alloccount.load()          # None if it cannot be built
    hook.install()
    calls, nbytes = hook.counts()

Around another program (how ``bench/ingest.py`` counts inside the gateway)::

    python bench/alloccount.py COUNTS_FILE -m headgate.cli serve ...
    python bench/alloccount.py COUNTS_FILE bench/ingest.py --baseline-server 0 DIR

installs the hook, then runs the module or script as ``__main__``. On
SIGUSR2 the process writes ``SERIAL CALLS BYTES`` to COUNTS_FILE (replacing
it); :func:`sample` sends the signal and waits for the answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import runpy
import shlex
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Protocol

SOURCE = Path(__file__).with_name("_alloc_hook.c")


class Hook(Protocol):
    def install(self) -> bool: ...

    def counts(self) -> tuple[int, int]: ...


def _build_dir() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + sys.version.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"headgate-alloc-hook-{os.getuid()}-{digest}"


def load() -> Hook | None:
    """Build (once) and import the hook module; None, with a reason on stderr, if it cannot."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    directory = _build_dir()
    target = directory / f"_alloc_hook{suffix}"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f"_alloc_hook.{os.getpid()}.partial{suffix}"
        compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
        command = [
            *compiler,
            "-O2",
            "-shared",
            "-fPIC",
            f"-I{sysconfig.get_paths()['include']}",
            str(SOURCE),
            "-o",
            str(partial),
        ]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            print(
                f"# allocation counts unavailable: cannot build {SOURCE.name} ({exc}) "
                f"{detail.decode(errors='replace')[-500:]}",
                file=sys.stderr,
            )
            return None
        os.replace(partial, target)
    spec = importlib.util.spec_from_file_location("_alloc_hook", target)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hook: Hook = module
    return hook


def sample(pid: int, counts_file: Path, timeout: float = 10.0) -> tuple[int, int]:
    """Ask a process run by this script for its counts: (calls, bytes)."""
    previous = _read(counts_file)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = _read(counts_file)
        if current is not None and (previous is None or current[0] != previous[0]):
            return current[1], current[2]
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} did not write its allocation counts to {counts_file}")


def _read(counts_file: Path) -> tuple[int, int, int] | None:
    with contextlib.suppress(OSError, ValueError):
        serial, calls, nbytes = counts_file.read_text().split()
        return int(serial), int(calls), int(nbytes)
    return None


def main(argv: list[str]) -> int:
    if len(argv) < 2 or (argv[1] == "-m" and len(argv) < 3):
        print(
            "usage: alloccount.py COUNTS_FILE (-m MODULE | SCRIPT) [ARGS...]\n"
            "Runs MODULE or SCRIPT with allocator calls counted; on SIGUSR2 writes\n"
            "'SERIAL CALLS BYTES' to COUNTS_FILE.",
            file=sys.stderr,
        )
        return 2
    counts_file = Path(argv[0])
    hook = load()
    if hook is None:
        return 1
    hook.install()
    serial = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal serial
        serial += 1
        calls, nbytes = hook.counts()
        partial = counts_file.with_suffix(".partial")
        partial.write_text(f"{serial} {calls} {nbytes}\n")
        os.replace(partial, counts_file)

    signal.signal(signal.SIGUSR2, on_signal)
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
