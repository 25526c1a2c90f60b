"""The fuzz harness in CI: replay the corpus, fuzz a few seconds, keep the regressions.

The long run, on demand (see README, "Fuzzing")::

    .venv/bin/python -m tests.fuzz.fuzz_session -max_total_time=600 tests/fuzz/corpus/session
"""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.targets import check_decoder, check_session

CORPUS = Path(__file__).parent / "corpus"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "target"), [("decoder", check_decoder), ("session", check_session)]
)
def test_every_corpus_input_keeps_the_invariants(name: str, target: object) -> None:
    assert callable(target)
    files = sorted((CORPUS / name).iterdir())
    assert len(files) >= 50, "the corpus is kept in the repository"
    for path in files:
        target(path.read_bytes())


# Inputs that broke an invariant once (base64, as libFuzzer prints them).
REGRESSIONS = [
    # A refusal in place of Welcome followed by more frames in the same read:
    # the session went on dispatching and raised BAD_HELLO over the refusal.
    ("session", "AwOEBBIAAAAAAAAAAQADhA=="),
    # Guarantees beyond 2**64-1, then a Plead: the Absolve could not be encoded
    # (a ValueError, not a ProtocolError).
    ("session", "AwHw////////ZOAA8P////////8LZOAA8GTgZOAA8PDw"),
    ("session", "ACOEBAwAAAAAAAQMAPk="),
]


@pytest.mark.parametrize(("name", "encoded"), REGRESSIONS)
def test_inputs_that_once_failed_keep_the_invariants(name: str, encoded: str) -> None:
    target = check_decoder if name == "decoder" else check_session
    target(base64.b64decode(encoded))


@given(st.binary(max_size=512))
def test_random_bytes_keep_the_decoder_invariants(data: bytes) -> None:
    check_decoder(data)


@given(st.binary(max_size=512))
def test_random_bytes_keep_the_session_invariants(data: bytes) -> None:
    check_session(data)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["decoder", "session"])
def test_a_short_coverage_guided_run_finds_nothing(name: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    # New inputs go to the first directory (a scratch one); the committed
    # corpus is read only.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            f"tests.fuzz.fuzz_{name}",
            "-max_total_time=3",
            "-timeout=5",
            "-rss_limit_mb=1024",
            f"-artifact_prefix={tmp_path}/",
            str(tmp_path),
            str(CORPUS / name),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done" in result.stderr
