"""The allocation counter that bench/ingest.py and bench/receive.py report with."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _alloccount() -> ModuleType:
    spec = importlib.util.spec_from_file_location("alloccount", BENCH / "alloccount.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def alloccount() -> ModuleType:
    module = _alloccount()
    if module.load() is None:
        pytest.skip("no C compiler to build bench/_alloc_hook.c")
    return module


def test_counts_every_allocation_in_this_process(alloccount: ModuleType) -> None:
    hook = alloccount.load()
    hook.install()
    assert hook.install() is False  # once only
    before = hook.counts()
    # 1,000 distinct bytes objects of 1,000 bytes each: one allocation apiece.
    kept = [bytes(1000) + bytes([i % 256]) for i in range(1000)]
    after = hook.counts()
    calls, asked = after[0] - before[0], after[1] - before[1]
    assert len(kept) == 1000
    assert calls >= 1000
    assert asked >= 1000 * 1001
    # Nothing allocated between two reads but the result tuples and ints.
    first, second = hook.counts(), hook.counts()
    assert second[0] - first[0] < 10


def test_wrapper_runs_a_script_and_answers_sigusr2(alloccount: ModuleType, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        "import sys, time\n"
        "print('ready', flush=True)\n"
        "kept = []\n"
        "for i in range(2000):\n"
        "    if sys.stdin.readline() == '':\n"
        "        break\n"
        "    kept.extend(bytes(100) + bytes([i % 256]) for _ in range(5000))\n"
        "    print('done', flush=True)\n"
    )
    counts = tmp_path / "counts"
    child = subprocess.Popen(
        [sys.executable, str(BENCH / "alloccount.py"), str(counts), str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "ready\n"
        first = alloccount.sample(child.pid, counts)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        second = alloccount.sample(child.pid, counts)
        assert second[0] - first[0] >= 5000
        assert second[1] - first[1] >= 5000 * 101
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(10)
    assert child.returncode == 0


def test_wrapper_without_a_program_explains_itself(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "alloccount.py"), str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "usage: alloccount.py COUNTS_FILE" in done.stderr


def test_sample_times_out_on_a_process_that_never_answers(
    alloccount: ModuleType, tmp_path: Path
) -> None:
    # A child that ignores SIGUSR2 and so never writes its counts.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGUSR2, "
            "signal.SIG_IGN); print('ready', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="did not write its allocation counts"):
            alloccount.sample(child.pid, tmp_path / "never", timeout=0.3)
        assert time.monotonic() - began < 5
    finally:
        os.kill(child.pid, signal.SIGTERM)
        child.wait(10)
