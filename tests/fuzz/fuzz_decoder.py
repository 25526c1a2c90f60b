"""Coverage-guided fuzzing of the frame decoder (see tests/fuzz/targets.py).

python -m tests.fuzz.fuzz_decoder -max_total_time=600 tests/fuzz/corpus/decoder
"""

from __future__ import annotations

import atheris

with atheris.instrument_imports(include=["headgate"]):
    from tests.fuzz.targets import check_decoder

from tests.fuzz._runner import run

if __name__ == "__main__":
    run(check_decoder, "tests.fuzz.fuzz_decoder")
