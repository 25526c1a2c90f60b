"""The ``headgate`` command: serve as a real process, send lines to it, refuse bad input."""

from __future__ import annotations

import ast
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from headgate.cli import COMMANDS, SUMMARIES, main
from headgate.client import ReleaseClient
from headgate.client.reader import SyncReader
from headgate.log import LogReader
from headgate.protocol.records import decode_records

from .serving import serve, stop

HEADGATE = [sys.executable, "-m", "headgate.cli"]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path, subprocess.Popen[str]]]:
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield line.split()[-1], data, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_send_stores_every_valid_line_and_serve_stops_cleanly_on_sigterm(
    served: tuple[str, Path, subprocess.Popen[str]], tmp_path: Path
) -> None:
    address, data, proc = served
    lines = [b'{"n": %d}' % i for i in range(500)]
    lines[7] = b"{oops"
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    result = subprocess.run(
        [*HEADGATE, "send", "events", str(source), "--gateway", address, "--format", "jsonl"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr  # some lines were not JSON
    # Issue 14: the summary came after a blank line, and the bad lines were
    # only counted.
    assert result.stdout.startswith("499 records ("), result.stdout
    assert result.stdout.count("\n") == 1
    assert (
        "headgate send: 1 line was not valid JSON and not sent: line 8 "
        "(line 8: column 2: Expecting property name enclosed in double quotes)\n"
    ) in result.stderr
    reader = LogReader.open(data / "streams" / "events")
    values: list[bytes] = []
    for frame in reader.read(reader.start_position()):
        values += decode_records(frame.payload).to_lists()[0]
    reader.close()
    assert values == [line for i, line in enumerate(lines) if i != 7]

    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped cleanly" in err


def test_serve_refuses_a_bad_config_with_a_clear_message(tmp_path: Path) -> None:
    config = tmp_path / "gw.toml"
    config.write_text('[gateway]\nterm_length = "3000"\n')
    result = CliRunner().invoke(main, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    assert "power of two" in result.output
    assert "Traceback" not in result.output
    # One line that names the file (issue 14), not a usage message.
    assert result.output.startswith(f"headgate serve: {config}: term_length must be a power")
    assert result.output.count("\n") == 1
    config.write_text('[streams.ticks]\ncapacity = "8MiB"\n')
    result = CliRunner().invoke(main, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    assert result.output == (
        f"headgate serve: {config}: streams.ticks.capacity (8MiB) must be at least two terms "
        "of term_length 16MiB: raise it to at least 32MiB, or lower term_length to 4MiB or less\n"
    )


def test_send_refuses_a_bad_stream_name_and_an_absent_gateway(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("a\n")
    result = CliRunner().invoke(main, ["send", "../etc", str(source)])
    assert result.exit_code == 2
    assert "not a stream name" in result.output
    absent = subprocess.run(
        [*HEADGATE, "send", "s", str(source), "--gateway", "127.0.0.1:1", "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert absent.returncode == 1
    assert "127.0.0.1:1" in absent.stderr
    assert "Traceback" not in absent.stderr


def test_serve_refuses_bad_policy_flags_with_a_clear_message() -> None:
    for args, needle in [
        (["--stream-policy", "nonsense"], "STREAM=POLICY"),
        (["--stream-policy", "ticks=fast"], "credit, window, xonxoff"),
        (["--policy", "fast"], "credit"),
        (["--window", "0"], "window"),
    ]:
        result = CliRunner().invoke(main, ["serve", *args])
        assert result.exit_code == 2, (args, result.output)
        assert needle in result.output
        assert "Traceback" not in result.output


def test_a_batch_at_the_last_u64_sequence_does_not_stop_serve(
    served: tuple[str, Path, subprocess.Popen[str]], tmp_path: Path
) -> None:
    # Issue 13: this frame once made `headgate serve` exit with a traceback.
    import socket

    from headgate.protocol import messages as m
    from headgate.protocol.codec import FrameDecoder, encode_frame
    from headgate.protocol.frames import IssueGuarantees, SendChannel, SendGlobal
    from headgate.protocol.records import encode_records

    address, data, proc = served
    host, port = address.rsplit(":", 1)
    decoder = FrameDecoder(max_payload=1 << 20)
    hello = m.Hello(producer_id=3, client_name="edge")
    frames = [
        SendChannel(channel=0, payload=m.encode_message(m.BindStream(stream="s"))),
        SendChannel(channel=2, payload=m.encode_batch_header(2**64 - 1) + encode_records([b"x"])),
    ]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(encode_frame(SendGlobal(payload=m.encode_message(hello))))
        seen: list[object] = []
        while not any(isinstance(f, IssueGuarantees) for f in seen):  # room to bind
            chunk = sock.recv(1 << 16)
            assert chunk, "closed before Welcome"
            seen += decoder.feed(chunk)
        sock.sendall(b"".join(encode_frame(f) for f in frames))
        received = b""
        while chunk := sock.recv(1 << 16):  # until the gateway closes
            received += chunk
    assert b"past the last sequence" in received
    source = tmp_path / "in.txt"
    source.write_text("after\n")
    result = subprocess.run(
        [*HEADGATE, "send", "t", str(source), "--gateway", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert proc.poll() is None, "serve is still running"
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    # Refused in the read that carried its bind: not even the stream was made.
    assert not (data / "streams" / "s").exists()


def test_send_resumes_a_producer_id_only_with_its_secret(
    served: tuple[str, Path, subprocess.Popen[str]], tmp_path: Path
) -> None:
    address, data, _ = served
    source = tmp_path / "in.txt"
    source.write_text("a\nb\n")

    def send(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*HEADGATE, "send", "s", str(source), "--gateway", address, "--timeout", "5", *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )

    first = send("--producer-id", "77")
    assert first.returncode == 0, first.stderr
    hint = next(line for line in first.stderr.splitlines() if "to resume" in line)
    secret = hint.split("--producer-secret ")[1].strip()
    assert len(bytes.fromhex(secret)) == 16
    stolen = send("--producer-id", "77")
    assert stolen.returncode == 1
    assert "PRODUCER_FENCED" in stolen.stderr and "Traceback" not in stolen.stderr
    assert secret not in stolen.stderr.split("to resume")[0]
    resumed = send("--producer-id", "77", "--producer-secret", secret)
    assert resumed.returncode == 0, resumed.stderr
    bad = send("--producer-secret", secret)
    assert bad.returncode == 2 and "goes with the --producer-id" in bad.stderr
    reader = LogReader.open(data / "streams" / "s")
    stored: list[tuple[int, int, list[bytes]]] = []
    for frame in reader.read(reader.start_position()):
        values = decode_records(frame.payload).to_lists()[0]
        stored.append((frame.producer_id, frame.first_sequence, values))
    reader.close()
    # The resumed producer numbers on where the first run ended; the fenced
    # one stored nothing.
    assert [v for _, _, vs in stored for v in vs] == [b"a", b"b", b"a", b"b"]
    assert {p for p, _, _ in stored} == {77}
    assert [first for _, first, _ in stored] == [0, 2]


def serve_on(data: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_second_serve_on_the_same_data_directory_exits_at_once_naming_the_first(
    served: tuple[str, Path, subprocess.Popen[str]],
) -> None:
    # Issue 14: a second gateway once started on the same directory and
    # refused each send with STORAGE_UNAVAILABLE.
    _, data, first = served
    second = subprocess.run(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert second.stdout == ""
    assert second.stderr.splitlines() == [
        f"headgate serve: the data directory {data} is in use by another gateway "
        f"(pid {first.pid}); stop it or choose another --data-dir"
    ]
    os.kill(first.pid, signal.SIGTERM)
    _, err = first.communicate(timeout=30)
    assert first.returncode == 0, err
    after = serve_on(data)
    try:
        assert after.stdout is not None
        assert after.stdout.readline().startswith("listening on ")
    finally:
        after.kill()
        after.wait(10)


def test_a_gateway_killed_with_sigkill_leaves_no_lock_behind(
    served: tuple[str, Path, subprocess.Popen[str]],
) -> None:
    _, data, first = served
    assert (data / "gateway.lock").read_text().strip() == str(first.pid)
    first.kill()  # SIGKILL: no handler runs, the kernel drops the lock
    first.wait(10)
    after = serve_on(data)
    try:
        assert after.stdout is not None
        line = after.stdout.readline()
        assert line.startswith("listening on "), after.stderr.read() if after.stderr else line
        assert (data / "gateway.lock").read_text().strip() == str(after.pid)
    finally:
        after.kill()
        after.wait(10)


def test_the_directory_lock_refuses_a_second_holder_in_the_same_process(tmp_path: Path) -> None:
    from headgate.log.lock import DirectoryInUse, DirectoryLock

    lock = DirectoryLock.acquire(tmp_path / "d", "gateway.lock")
    with pytest.raises(DirectoryInUse) as refused:
        DirectoryLock.acquire(tmp_path / "d", "gateway.lock")
    assert refused.value.pid == os.getpid()
    assert refused.value.directory == tmp_path / "d"
    lock.release()
    lock.release()  # a second release does nothing
    DirectoryLock.acquire(tmp_path / "d", "gateway.lock").release()


def test_version_is_the_installed_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import importlib.metadata

    import headgate

    assert headgate.__version__ == importlib.metadata.version("headgate")
    for flag in ("--version", "-V"):
        result = CliRunner().invoke(main, [flag])
        assert result.exit_code == 0
        assert result.output == f"headgate {headgate.__version__}\n"

    def absent(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    # A source tree that was never installed still has a version to show.
    monkeypatch.setattr(importlib.metadata, "version", absent)
    try:
        assert importlib.reload(headgate).__version__ == "0+unknown"
    finally:
        monkeypatch.undo()
        importlib.reload(headgate)
    assert headgate.__version__ == importlib.metadata.version("headgate")


def test_ctrl_c_reports_what_was_acknowledged_and_how_to_resume(
    served: tuple[str, Path, subprocess.Popen[str]],
) -> None:
    address, data, _ = served
    sender = subprocess.Popen(
        [*HEADGATE, "send", "events", "-", "--gateway", address, "--format", "jsonl"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert sender.stdin is not None
        sender.stdin.write(b'{"n": 1}\nnot json\n{"n": 2}\n{"n": 3}\n')
        sender.stdin.flush()  # and left open: the read waits for more
        deadline = time.monotonic() + 30
        stored: list[bytes] = []
        while len(stored) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            if (data / "streams" / "events").exists():
                reader = LogReader.open(data / "streams" / "events")
                stored = [
                    v
                    for f in reader.read(reader.start_position())
                    for v in decode_records(f.payload).to_lists()[0]
                ]
                reader.close()
        assert len(stored) == 3
        time.sleep(0.5)  # the acknowledgement reaches the sender
        sender.send_signal(signal.SIGINT)
        out, err = sender.communicate(timeout=30)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(10)
    lines = err.decode().splitlines()
    assert sender.returncode == 130, lines
    assert out == b""
    assert lines[0] == (
        "headgate send: interrupted: 3 of 3 records acknowledged durable on events "
        "(input up to line 4 is done; go on from line 5)"
    )
    assert lines[1].startswith("headgate send: 1 line was not valid JSON and not sent: line 2 ")
    assert lines[2].startswith("to resume this producer: --producer-id ")
    assert "--producer-secret " in lines[2]
    assert len(lines) == 3


def test_the_line_of_a_record_skips_the_bad_lines() -> None:
    from headgate.cli.send import SendReport

    report = SendReport("s")
    report.bad_lines.extend([1, 2, 5, 9])
    # Lines 3, 4, 6, 7, 8, 10 hold records 1 to 6.
    assert [report.line_of_record(k) for k in range(1, 7)] == [3, 4, 6, 7, 8, 10]
    report.bad_lines.extend(range(10, 30))
    report.first_bad_reason = "why"
    assert report.bad_lines_message() == (
        "24 lines were not valid JSON and not sent: lines 1, 2, 5, 9, 10, 11, 12, 13, 14, 15 "
        "and 14 more (line 1: why)"
    )


def test_an_interrupted_report_tells_stored_from_unknown() -> None:
    from headgate.cli.send import SendReport

    report = SendReport("s", sent=10, transmitted=7, acked=4, interrupted=True, connected=True)
    report.bad_lines.append(2)
    assert report.interrupted_message() == (
        "interrupted: 4 of 10 records acknowledged durable on s (input up to line 5 is "
        "done; go on from line 6); 3 more reached the gateway without an acknowledgement "
        "(they may be stored)"
    )
    nothing = SendReport("s", sent=3, interrupted=True, connected=True)
    assert nothing.interrupted_message() == (
        "interrupted: 0 of 3 records acknowledged durable on s (go on from line 1)"
    )


def readme_shell_lines() -> list[str]:
    """The command lines of README.md's ```sh blocks, continuations joined."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```sh\n(.*?)^```$", readme, re.MULTILINE | re.DOTALL)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def test_every_shell_example_of_the_readme_parses_and_names_real_options() -> None:
    import click

    lines = readme_shell_lines()
    syntax = subprocess.run(
        ["bash", "-n"], input="\n".join(lines), capture_output=True, text=True, timeout=30
    )
    assert syntax.returncode == 0, syntax.stderr
    checked = 0
    for line in lines:
        words = shlex.split(line, comments=True)
        while words and "=" in words[0]:  # VAR=value before the command
            words.pop(0)
        for cut in ("|", ">>", ">"):
            words = words[: words.index(cut)] if cut in words else words
        if not words or not words[0].endswith("headgate"):
            continue
        args = words[1:]
        command: click.Command = main
        # Into the command, and into a group's subcommand (headgate streams list).
        while isinstance(command, click.Group) and args and not args[0].startswith("-"):
            sub = command.get_command(click.Context(command), args[0])
            assert sub is not None, f"no command {command.name} {args[0]}: {line}"
            command, args = sub, args[1:]
        known = {name for param in command.params for name in param.opts + param.secondary_opts}
        known |= {"-h", "--help"}
        unknown = [
            a.split("=")[0] for a in args if a.startswith("-") and a.split("=")[0] not in known
        ]
        assert unknown == [], f"headgate {command.name}: no option {unknown}: {line}"
        checked += 1
    assert checked >= 20, checked


def test_ctrl_c_while_the_gateway_does_not_answer_says_nothing_was_sent(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    sender = subprocess.Popen(
        [*HEADGATE, "send", "s", "-", "--gateway", address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2.0)  # retrying its connection
        sender.send_signal(signal.SIGINT)
        out, err = sender.communicate(timeout=30)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(10)
    assert sender.returncode == 130
    assert (out, err) == (
        "",
        f"headgate send: interrupted before gateway {address} answered; nothing was sent\n",
    )


#: A stream of two small terms, which a few thousand lines fill.
SMALL_STREAM = (
    '[gateway]\nterm_length = "64KiB"\nmax_message_size = "16KiB"\n'
    '[streams.events]\ncapacity = "128KiB"\n'
)


def _send_until_full(tmp_path: Path, address: str) -> str:
    """Send more than the stream holds; the notice ``headgate send`` gives once the
    stream stays full (or all it said), then Ctrl-C."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(b'{"n": %d, "pad": "%s"}\n' % (i, b"x" * 200) for i in range(5000)))
    sender = subprocess.Popen(
        [*HEADGATE, "send", "events", str(source), "--gateway", address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stderr is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(sender.stderr or ()))
        reader.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("is full" in x for x in lines):
            if sender.poll() is not None:
                break
            time.sleep(0.1)
        sender.send_signal(signal.SIGINT)
        sender.wait(30)
        reader.join(10)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(10)
    return next((x for x in lines if "is full" in x), "".join(lines))


def test_send_says_when_its_stream_stays_full_and_why(tmp_path: Path) -> None:
    # A stream of two small terms that nobody releases fills at once.
    config = tmp_path / "gw.toml"
    config.write_text(SMALL_STREAM)
    gateway, address = serve(tmp_path / "data", "-c", str(config))
    try:
        said = _send_until_full(tmp_path, address)
    finally:
        stop(gateway)
    assert said.startswith("headgate send: events is full for 2 s: its log is full"), said
    assert "until the stream's consumer" in said
    assert "its log is full and no consumer has released it since the gateway started:" in said


def test_send_says_since_when_the_consumer_of_a_full_stream_has_not_released(
    tmp_path: Path,
) -> None:
    config = tmp_path / "gw.toml"
    config.write_text(SMALL_STREAM)
    gateway, address = serve(tmp_path / "data", "-c", str(config))
    try:
        first = tmp_path / "first.txt"
        first.write_text("one\ntwo\n")
        sent = subprocess.run(
            [*HEADGATE, "send", "events", str(first), "--gateway", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        # A consumer reads the two records, releases them once, and stops.
        with SyncReader(address) as reader:
            (info,) = reader.list_streams()
        with ReleaseClient(address) as client:
            client.release("events", info.durable_position)
            assert client.flush(10)
        said = _send_until_full(tmp_path, address)
    finally:
        stop(gateway)
    assert said.startswith("headgate send: events is full for 2 s: its log is full and "), said
    since = re.search(
        r"its consumer has not released it since \d\d:\d\d:\d\d UTC \((\d+) s ago\): ", said
    )
    assert since is not None, said
    assert 2 <= int(since.group(1)) <= 60  # the stream filled after the release
    assert "until the stream's consumer" in said


def test_send_with_a_spool_that_gave_up_says_where_to_go_on(
    served: tuple[str, Path, subprocess.Popen[str]], tmp_path: Path
) -> None:
    address, data, _ = served
    spool = tmp_path / "spool"
    source = tmp_path / "in.txt"
    source.write_text("one\ntwo\nthree\n")
    absent = ["--gateway", "127.0.0.1:1", "--timeout", "1", "--spool", str(spool)]
    away = subprocess.run(
        [*HEADGATE, "send", "s", str(source), *absent],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert away.returncode == 1, away.stderr
    assert f"The spool {spool} keeps every record not acknowledged" in away.stderr
    assert "input from line 1" in away.stderr  # it gave up before taking any
    assert "Traceback" not in away.stderr
    again = subprocess.run(
        [*HEADGATE, "send", "s", str(source), "--gateway", address, "--spool", str(spool)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("3 records ("), again.stdout
    assert sorted(spool.glob("*.seg")) == []  # all acknowledged: nothing kept
    reader = LogReader.open(data / "streams" / "s")
    values: list[bytes] = []
    for frame in reader.read(reader.start_position()):
        values += decode_records(frame.payload).to_lists()[0]
    reader.close()
    assert values == [b"one", b"two", b"three"]


def test_each_command_of_the_table_is_found_under_its_name() -> None:
    import click

    found = {name: main.get_command(click.Context(main), name) for name in COMMANDS}
    assert {name: command.name for name, command in found.items() if command} == {
        name: name for name in COMMANDS
    }
    assert main.list_commands(click.Context(main)) == sorted(COMMANDS)
    assert main.get_command(click.Context(main), "nosuch") is None


def _in_a_fresh_interpreter(script: str) -> str:
    """What ``script`` prints, run by a new Python (this one has imported every command)."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_command_imports_its_own_module_and_no_other_commands() -> None:
    # In a fresh interpreter: this one has imported every command already.
    script = (
        "import sys, click\n"
        "from headgate.cli import main\n"
        "main.get_command(click.Context(main), 'serve')\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('headgate.cli.'))))\n"
    )
    assert _in_a_fresh_interpreter(script).split() == ["headgate.cli.serve", "headgate.cli.text"]


def test_the_list_of_commands_is_each_commands_own_summary_and_imports_none() -> None:
    import click

    # Each summary of the table is what the command's own help makes of it,
    # at every width click may give it.
    for name in COMMANDS:
        command = main.get_command(click.Context(main), name)
        assert command is not None
        for limit in (30, 45, 60, 200):
            summary = click.Command(name, help=SUMMARIES[name]).get_short_help_str(limit)
            assert summary == command.get_short_help_str(limit), (name, limit)
    assert sorted(SUMMARIES) == sorted(COMMANDS)
    # `headgate --help`, in a fresh interpreter: the same text as click's own
    # listing (which imports every command), and no command module imported.
    script = (
        "import sys, click\n"
        "from headgate.cli import main\n"
        "ctx = click.Context(main, info_name='headgate')\n"
        "ours = main.get_help(ctx)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('headgate.cli.'))\n"
        "formatter = ctx.make_formatter()\n"
        "main.format_usage(ctx, formatter)\n"
        "main.format_help_text(ctx, formatter)\n"
        "click.Command.format_options(main, ctx, formatter)\n"
        "click.Group.format_commands(main, ctx, formatter)\n"
        "main.format_epilog(ctx, formatter)\n"
        "print(repr((ours, loaded, formatter.getvalue())))\n"
    )
    ours, loaded, clicks = ast.literal_eval(_in_a_fresh_interpreter(script))
    assert loaded == []
    assert ours == clicks.rstrip("\n")
    assert "\n  serve      Run the gateway until" in ours
