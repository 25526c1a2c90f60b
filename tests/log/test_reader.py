"""LogReader: another process reads while the writer appends, with no locks."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from headgate.log import LogCorruptError, LogError, LogReader, StreamLog
from tests.log import _frames

READER = Path(__file__).with_name("_reader_child.py")
TERM = 16 * 1024


def test_a_reader_process_sees_every_frame_whole_while_the_writer_appends(
    tmp_path: Path,
) -> None:
    with StreamLog.open(tmp_path, term_length=TERM, capacity=4096 * TERM) as log:
        # Know the last sequence up front: frame sequences are deterministic.
        count = 15_000
        seq = 0
        for _ in range(count):
            seq += _frames.record_count(seq)
        last_seq = seq
        child = subprocess.Popen(
            [sys.executable, str(READER), str(tmp_path), str(last_seq), "40"],
            stdout=subprocess.PIPE,
            text=True,
        )
        stop = threading.Event()

        def committer() -> None:
            while not stop.is_set():
                log.sync()
                time.sleep(0.002)

        thread = threading.Thread(target=committer)
        thread.start()
        try:
            seq = 0
            for index in range(count):
                _frames.append(log, seq)
                seq += _frames.record_count(seq)
                if index % 500 == 0:
                    time.sleep(0.002)  # let the reader catch up now and then
            out, _ = child.communicate(timeout=60)
        finally:
            stop.set()
            thread.join(10)
            if child.poll() is None:
                child.kill()
                child.wait(10)
        assert child.returncode == 0, out
        stats = json.loads(out)
        print(stats)
        assert stats["frames"] == count
        # It read while the writer wrote, not only at the end.
        assert stats["reads"] > 1


def test_reader_positions_follow_the_writer(tmp_path: Path) -> None:
    with StreamLog.open(tmp_path, term_length=TERM, capacity=64 * TERM) as log:
        results, _ = _frames.append_many(log, 100)
        with LogReader.open(tmp_path) as reader:
            assert reader.term_length == TERM
            assert reader.published_position() == log.tail_position
            assert reader.durable_position() == 0
            assert reader.start_position() == 0
            log.sync()
            assert reader.durable_position() == log.tail_position
            frames = reader.read(0)
            assert [f.position for f in frames] == [r.position for r in results]
            assert frames[0].payload.readonly
            log.release(results[50].position)
            assert reader.start_position() == results[50].position
            with pytest.raises(LogError, match="start position"):
                reader.read(results[10].position)
            assert reader.read(results[50].position)[0].first_sequence == (
                frames[50].first_sequence
            )
            with pytest.raises(LogError, match="published"):
                reader.read(results[50].position, log.tail_position + 8)
        with pytest.raises(LogError, match="closed"):
            reader.published_position()


def test_a_reader_needs_an_existing_log(tmp_path: Path) -> None:
    with pytest.raises(LogError, match="not a stream log"):
        LogReader.open(tmp_path)


def test_a_reader_reports_damage_below_the_published_position(tmp_path: Path) -> None:
    with StreamLog.open(tmp_path, term_length=TERM, capacity=64 * TERM) as log:
        results, _ = _frames.append_many(log, 20)
        victim = results[10]
        term = tmp_path / "0000000000000000.term"
        with term.open("r+b") as f:
            f.seek(victim.position + 45)
            byte = f.read(1)
            f.seek(victim.position + 45)
            f.write(bytes([byte[0] ^ 0x40]))
        with LogReader.open(tmp_path) as reader:
            with pytest.raises(LogCorruptError) as caught:
                reader.read(0)
            assert caught.value.path == str(term)
            assert caught.value.offset == victim.position
            assert "checksum" in str(caught.value)
            # Frames before the damage are fine.
            assert len(reader.read(0, victim.position)) == 10
