"""Coverage-guided fuzzing of the session, both roles (see tests/fuzz/targets.py).

python -m tests.fuzz.fuzz_session -max_total_time=600 tests/fuzz/corpus/session
"""

from __future__ import annotations

import atheris

with atheris.instrument_imports(include=["headgate"]):
    from tests.fuzz.targets import check_session

from tests.fuzz._runner import run

if __name__ == "__main__":
    run(check_session, "tests.fuzz.fuzz_session")
