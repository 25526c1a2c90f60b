"""How fast headgate frames 100-byte records, beside plain length-prefix framing.

The gateway aims at a million records a second, and every record passes
through this codec twice (the producer encodes, the gateway decodes). This
script measures frames per second for 100-byte SendChannel frames. It encodes
and decodes one frame per call, in batches of 1000 frames, and in a stream cut
into 64 KiB reads that split frames anywhere. Each row is set beside a
baseline, measured in the same run: a 4-byte ``struct`` length prefix followed
by the payload, written in straightforward idiomatic Python.

The comparison is not quite even, and the difference favours the baseline:
headgate decodes to ``SendChannel`` objects that carry a channel, while the
baseline returns bare ``bytes``.

Run::

    .venv/bin/python bench/codec.py            # about 5 s on a 2-core machine
    .venv/bin/python bench/codec.py --quick    # about 1 s, rougher
"""

from __future__ import annotations

import argparse
import os
import platform
import struct
import sys
import time
from collections.abc import Callable

from headgate.protocol.codec import FrameDecoder, encode_frame, encode_frame_into
from headgate.protocol.frames import Frame, SendChannel

PAYLOAD_SIZE = 100
BATCH = 1000
READ_SIZE = 64 * 1024

_LENGTH = struct.Struct("<I")


class LengthPrefixDecoder:
    """The baseline: a 4-byte little-endian length, then that many bytes."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        buffer = self._buffer
        out = []
        pos = 0
        while len(buffer) - pos >= 4:
            (length,) = _LENGTH.unpack_from(buffer, pos)
            end = pos + 4 + length
            if end > len(buffer):
                break
            out.append(bytes(buffer[pos + 4 : end]))
            pos = end
        del buffer[:pos]
        return out


def baseline_encode(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def baseline_encode_into(payload: bytes, out: bytearray) -> None:
    out += _LENGTH.pack(len(payload))
    out += payload


def best_rates(
    ours: Callable[[], int], theirs: Callable[[], int], repeats: int
) -> tuple[float, float]:
    """Frames per second of the fastest of ``repeats`` runs of each, after a warm-up.

    The two alternate, so that a noisy neighbour slows both rather than one.
    """
    best = [float("inf"), float("inf")]
    for attempt in range(repeats + 1):
        for side, run in enumerate((ours, theirs)):
            start = time.perf_counter()
            count = run()
            if attempt:
                best[side] = min(best[side], (time.perf_counter() - start) / count)
    return 1.0 / best[0], 1.0 / best[1]


def chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer frames and repeats")
    args = parser.parse_args()
    total = 50_000 if args.quick else 200_000
    repeats = 3 if args.quick else 7

    payloads = [os.urandom(PAYLOAD_SIZE) for _ in range(BATCH)]
    frames: list[Frame] = [
        SendChannel(channel=2 + i % 10, payload=p) for i, p in enumerate(payloads)
    ]
    rounds = total // BATCH

    ours_single = [encode_frame(f) for f in frames]
    theirs_single = [baseline_encode(p) for p in payloads]
    ours_batch = b"".join(ours_single)
    theirs_batch = b"".join(theirs_single)
    ours_stream = chunks(ours_batch * rounds, READ_SIZE)
    theirs_stream = chunks(theirs_batch * rounds, READ_SIZE)

    # Check that both sides do the work being timed before timing it.
    assert FrameDecoder(max_payload=1 << 20).feed(ours_batch) == frames
    assert LengthPrefixDecoder().feed(theirs_batch) == payloads

    def encode_one_ours() -> int:
        for _ in range(rounds):
            for frame in frames:
                encode_frame(frame)
        return rounds * BATCH

    def encode_one_theirs() -> int:
        for _ in range(rounds):
            for payload in payloads:
                baseline_encode(payload)
        return rounds * BATCH

    def encode_batch_ours() -> int:
        for _ in range(rounds):
            out = bytearray()
            for frame in frames:
                encode_frame_into(frame, out)
        return rounds * BATCH

    def encode_batch_theirs() -> int:
        for _ in range(rounds):
            out = bytearray()
            for payload in payloads:
                baseline_encode_into(payload, out)
        return rounds * BATCH

    def decode_one_ours() -> int:
        decoder = FrameDecoder(max_payload=1 << 20)
        for _ in range(rounds):
            for data in ours_single:
                decoder.feed(data)
        return rounds * BATCH

    def decode_one_theirs() -> int:
        decoder = LengthPrefixDecoder()
        for _ in range(rounds):
            for data in theirs_single:
                decoder.feed(data)
        return rounds * BATCH

    def decode_batch_ours() -> int:
        decoder = FrameDecoder(max_payload=1 << 20)
        for _ in range(rounds):
            decoder.feed(ours_batch)
        return rounds * BATCH

    def decode_batch_theirs() -> int:
        decoder = LengthPrefixDecoder()
        for _ in range(rounds):
            decoder.feed(theirs_batch)
        return rounds * BATCH

    def decode_stream_ours() -> int:
        decoder = FrameDecoder(max_payload=1 << 20)
        count = 0
        for data in ours_stream:
            count += len(decoder.feed(data))
        return count

    def decode_stream_theirs() -> int:
        decoder = LengthPrefixDecoder()
        count = 0
        for data in theirs_stream:
            count += len(decoder.feed(data))
        return count

    rows = [
        ("encode, 1 frame per call", encode_one_ours, encode_one_theirs),
        (f"encode, {BATCH} frames per buffer", encode_batch_ours, encode_batch_theirs),
        ("decode, 1 frame per feed", decode_one_ours, decode_one_theirs),
        (f"decode, {BATCH} frames per feed", decode_batch_ours, decode_batch_theirs),
        ("decode, 64 KiB reads", decode_stream_ours, decode_stream_theirs),
    ]

    print(
        f"headgate codec, {PAYLOAD_SIZE}-byte SendChannel payloads, {total} frames per run, "
        f"best of {repeats}; Python {platform.python_version()} on {platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    print()
    print(f"| {'operation':<32} | {'headgate frames/s':>17} | {'baseline frames/s':>17} | ratio |")
    print(f"|{'-' * 34}|{'-' * 18}:|{'-' * 18}:|------:|")
    for name, ours, theirs in rows:
        ours_rate, theirs_rate = best_rates(ours, theirs, repeats)
        print(
            f"| {name:<32} | {ours_rate:>17,.0f} | {theirs_rate:>17,.0f} "
            f"| {ours_rate / theirs_rate:>5.2f} |"
        )
        sys.stdout.flush()
    print()
    print("ratio = headgate / baseline (above 1: headgate is faster).")
    print("baseline: struct 4-byte length prefix + payload; its decoder returns bare bytes.")


if __name__ == "__main__":
    main()
