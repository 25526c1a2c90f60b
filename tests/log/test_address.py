"""Record addresses: written one way, read back the same, and nothing else is taken."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.log.address import MAX_INDEX, AddressError, RecordAddress
from headgate.log.position import MAX_POSITION


@given(st.integers(0, MAX_POSITION), st.integers(0, MAX_INDEX - 1))
def test_every_address_reads_back_as_written(position: int, index: int) -> None:
    """What the output shows (str) is what --from and startingOffsets take back (parse)."""
    address = RecordAddress(position, index)
    assert RecordAddress.parse(str(address)) == address


def test_a_position_alone_is_the_first_record_of_its_batch() -> None:
    assert RecordAddress.parse("4096") == RecordAddress.parse("4096:0") == RecordAddress(4096, 0)
    assert str(RecordAddress(4096)) == "4096" and str(RecordAddress(4096, 2)) == "4096:2"
    assert RecordAddress.parse(" 007:01 ") == RecordAddress(7, 1)
    assert RecordAddress(4096, 1) < RecordAddress(4096, 2) < RecordAddress(4097, 0)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "'' is not a record address (POSITION or POSITION:INDEX)"),
        ("-1", "'-1' is not a record address"),
        ("4096:-1", "'4096:-1' is not a record address"),
        ("+5", "not a record address"),
        ("1_000", "not a record address"),  # int() would take it
        ("\u0661\u0662", "not a record address"),  # Arabic-Indic digits: int() would take them
        ("4096:", "not a record address"),
        (":2", "not a record address"),
        ("1:2:3", "not a record address"),
        ("0x10", "not a record address"),
        ("1e3", "not a record address"),
        ("4 096", "not a record address"),
        ("now", "not a record address"),
        ("9" * 5000, "is larger than a log position can be"),
        (str(MAX_POSITION + 1), "is larger than a log position can be"),
        (f"0:{MAX_INDEX}", f"index {MAX_INDEX} is larger than a batch can hold"),
        ("0:" + "9" * 40, "is larger than a batch can hold"),
    ],
)
def test_anything_else_is_refused_saying_why(text: str, why: str) -> None:
    with pytest.raises(AddressError, match=why.replace("(", r"\(").replace(")", r"\)")):
        RecordAddress.parse(text)


def test_an_address_is_checked_against_the_batch_the_log_has_there() -> None:
    RecordAddress(4096, 2).check_in_frame("s", 4096, 3)
    with pytest.raises(AddressError, match=r"^position 4100 is not where a batch of 's' starts"):
        RecordAddress(4100).check_in_frame("s", 4224, 1)
    with pytest.raises(AddressError) as past:
        RecordAddress(4096, 3).check_in_frame("s", 4096, 3)
    assert str(past.value) == (
        "record address 4096:3 is past the end of its batch in 's': the batch at position "
        "4096 holds 3 records (indexes 0 to 2)"
    )
    with pytest.raises(AddressError, match=r"outside 0 to"):
        RecordAddress(-1)
    with pytest.raises(AddressError, match=r"outside 0 to"):
        RecordAddress(0, MAX_INDEX)
