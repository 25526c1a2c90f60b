"""Type stub of the optional C frame writer (src/headgate/log/_frame_writer.c)."""

import mmap
from typing import TypeVar, overload

_R = TypeVar("_R", bound=tuple[int, int])
_Buffer = mmap.mmap | bytearray | memoryview

@overload
def write_frame(
    term: int | _Buffer,
    term_size: int,
    offset: int,
    position: int,
    limit: int,
    payload: bytes | bytearray | memoryview,
    producer_id: int,
    first_sequence: int,
    record_count: int,
    timestamp_us: int,
    meta: _Buffer | None,
    published_offset: int,
    result_type: None,
    /,
) -> int: ...
@overload
def write_frame(
    term: int | _Buffer,
    term_size: int,
    offset: int,
    position: int,
    limit: int,
    payload: bytes | bytearray | memoryview,
    producer_id: int,
    first_sequence: int,
    record_count: int,
    timestamp_us: int,
    meta: _Buffer | None,
    published_offset: int,
    result_type: type[_R],
    /,
) -> _R | None: ...
