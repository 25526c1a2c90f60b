"""Type stub of the optional C frame writer (src/headgate/log/_frame_writer.c)."""

import mmap

def write_frame(
    term: mmap.mmap,
    offset: int,
    position: int,
    limit: int,
    payload: bytes | bytearray | memoryview,
    producer_id: int,
    first_sequence: int,
    record_count: int,
    timestamp_us: int,
    meta: mmap.mmap | None,
    published_offset: int,
    /,
) -> int: ...
