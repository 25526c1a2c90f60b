"""Position arithmetic and the public surface of headgate.log."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

import headgate.log
from headgate.log import FRAME_ALIGNMENT, HEADER_LENGTH, frame_cost
from headgate.log.frame import checksum_seed
from headgate.log.position import (
    MAX_POSITION,
    align,
    compute_position,
    normalize_position,
    position_bits_to_shift,
    term_id_of,
    term_offset_of,
    term_start,
)

term_lengths = st.sampled_from([2**k for k in range(12, 31)])


@given(term_length=term_lengths, position=st.integers(0, MAX_POSITION))
def test_a_position_splits_into_term_and_offset_and_back(term_length: int, position: int) -> None:
    shift = position_bits_to_shift(term_length)
    term_id = term_id_of(position, shift)
    offset = term_offset_of(position, term_length)
    assert 0 <= offset < term_length
    assert compute_position(term_id, offset, shift) == position
    assert term_start(term_id, shift) <= position < term_start(term_id + 1, shift)


@given(term_length=term_lengths, term_id=st.integers(0, 2**20), offset=st.integers(0, 2**30))
def test_term_and_offset_make_a_position_and_back(
    term_length: int, term_id: int, offset: int
) -> None:
    offset %= term_length
    shift = position_bits_to_shift(term_length)
    position = compute_position(term_id, offset, shift)
    assert (term_id_of(position, shift), term_offset_of(position, term_length)) == (term_id, offset)


@given(term_length=term_lengths, position=st.integers(0, 2**50))
def test_normalizing_skips_only_the_headerless_end_of_a_term(
    term_length: int, position: int
) -> None:
    position = align(position, FRAME_ALIGNMENT)
    normal = normalize_position(position, term_length, HEADER_LENGTH)
    left = term_length - position % term_length
    if position % term_length and left < HEADER_LENGTH:
        assert normal == position + left
        assert normal % term_length == 0
    else:
        assert normal == position
    assert normalize_position(normal, term_length, HEADER_LENGTH) == normal


@given(length=st.integers(0, 2**30))
def test_frame_cost_is_the_aligned_frame_length(length: int) -> None:
    cost = frame_cost(length)
    assert cost == align(HEADER_LENGTH + length, FRAME_ALIGNMENT)
    assert cost % FRAME_ALIGNMENT == 0


@given(
    term_length=term_lengths,
    offset=st.integers(0, 2**30),
    first=st.integers(0, 2**40),
    distance=st.integers(1, 2**32 - 1),
)
def test_the_same_offset_in_two_terms_gets_two_checksum_seeds(
    term_length: int, offset: int, first: int, distance: int
) -> None:
    # Positions with the same term offset, less than 4 GiB apart.
    shift = position_bits_to_shift(term_length)
    offset %= term_length
    terms_apart = max(1, distance >> shift)
    if terms_apart << shift >= 2**32:
        return
    a = compute_position(first, offset, shift)
    b = compute_position(first + terms_apart, offset, shift)
    assert checksum_seed(a) != checksum_seed(b)


def test_the_public_names() -> None:
    assert sorted(headgate.log.__all__) == sorted(
        [
            "DEFAULT_TERM_LENGTH",
            "FRAME_ALIGNMENT",
            "HEADER_LENGTH",
            "AppendResult",
            "FrameHeader",
            "LogCorruptError",
            "LogError",
            "LogFrame",
            "LogFullError",
            "LogReader",
            "RecoveryReport",
            "StorageError",
            "StorageFull",
            "StreamLog",
            "compute_position",
            "frame_cost",
            "term_id_of",
            "term_offset_of",
        ]
    )
    for name in headgate.log.__all__:
        assert getattr(headgate.log, name) is not None
    assert issubclass(headgate.log.LogFullError, headgate.log.LogError)
    assert issubclass(headgate.log.StorageFull, headgate.log.StorageError)
    assert issubclass(headgate.log.StorageError, headgate.log.LogError)
    assert issubclass(headgate.log.LogCorruptError, headgate.log.LogError)


def test_corrupt_errors_survive_pickling() -> None:
    import pickle

    error = headgate.log.LogCorruptError("/x/0.term", 64, "checksum mismatch")
    again = pickle.loads(pickle.dumps(error))
    assert (again.path, again.offset, again.reason) == ("/x/0.term", 64, "checksum mismatch")
    assert str(again) == str(error)
