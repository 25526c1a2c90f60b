"""The hostile-peer suite: a real gateway, a good producer, and one attack at a time.

One ``headgate serve`` process (a tokens file and small limits:
``harness.CONFIG``) serves the whole module, and a second one with TLS serves
the TLS attack. For each attack in ``attacks.ATTACKS``, the good producer
sends records on a stream of its own, alone and under attack, interleaved
A B A B (``harness.measure``). Then, for each attack:

* the gateway is still up and still stores (and at the end stops cleanly);
* its anonymous memory (RssAnon) grew by less than ``MEMORY_BOUND`` over its
  level before the attack, sampled all through the attack (plus
  ``CONNECTION_MEMORY`` for each connection beyond 40 that an attack holds);
* the good producer kept at least ``THROUGHPUT_RATIO`` of its throughput: the
  median over pairs of runs (alone, then attacked, back to back) of attacked
  over alone, so that a machine busy for other reasons slows both runs of a
  pair alike, while a producer that an attack starves falls far below in
  every pair (an attack that looks
  harmful after ``ROUNDS`` pairs is measured for up to ``MORE_ROUNDS`` more,
  and the medians of all pairs decide);
* the good producer lost nothing: its stream holds every record it sent,
  exactly once, in order (its producer id tells its frames apart);
* the offender got the documented answer (PROTOCOL.md, "Who gets in, and
  limits"; issue 13): its Error codes, closes, or AnnounceDropping.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from headgate.log import LogReader, frame_cost
from headgate.protocol.errors import ErrorCode
from tests.hostile.attacks import ATTACKS, DOCUMENTED
from tests.hostile.harness import (
    BENCH_ONLY,
    TLS_ATTACKS,
    Arena,
    Attacker,
    Measured,
    good_run,
    measure,
    victim_stream,
)

pytestmark = pytest.mark.timeout(120)

#: Rounds of A B, and the length of each good-producer run (seconds): short,
#: to keep the suite within a few minutes on two cores; ``bench/hostile.py``
#: runs longer.
ROUNDS = 2
#: Extra rounds (one pair each) for an attack whose first rounds look harmful.
MORE_ROUNDS = 3
GOOD_SECONDS = 0.5
#: Attacks whose harm the gateway bounds by a deadline rather than by a
#: share: writers that ignore a Plead keep the good stream's credit until the
#: arena's plead_deadline_ms (0.5 s) has passed, so a good run of a few tenths
#: of a second cannot keep half its rate. For these the check is that an
#: attacked run took at most the deadline (plus this slack: the 0.1 s check
#: and a busy machine) longer than a run alone. (The deadline itself is
#: tested deterministically in tests/gateway/test_sharing.py; here the hogs
#: do not always hold the credit when the good producer binds.)
DEADLINE_BOUND_S = {"plead_ignored": 0.5}
DEADLINE_SLACK_S = 0.6
GOOD_SECONDS_FOR = {"plead_ignored": 2.5}
GOOD_RECORDS = 400_000
#: The good producer keeps at least this share of its throughput alone.
#: Loose for noise (issue 13's target, on a quiet machine, is 0.9; see
#: bench/hostile.py), but far above what a starved producer keeps.
THROUGHPUT_RATIO = 0.5
#: How much the gateway's anonymous memory may grow during an attack. Its
#: buffers are bounded per connection by max_message_size (a partial frame),
#: one 256 KiB read and max_write_buffer; ~40 connections at once stay far
#: below this (about 5 MiB was seen), while a gateway that buffered what the
#: attackers send (tens of MiB per attack) would not.
MEMORY_BOUND = 24 * 1024 * 1024
#: Attacks that hold more than 40 connections open at once, and how many: each
#: may cost the gateway up to CONNECTION_MEMORY more (a read and a write cap).
HELD_CONNECTIONS = {"reader_slots": 136, "slowloris_half_frame": 80, "ping_flood_60": 60}
CONNECTION_MEMORY = 320 * 1024


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arena]:
    served = Arena(tmp_path_factory.mktemp("hostile"))
    served.start()
    try:
        yield served
        assert served.alive(), "the gateway died"
    finally:
        code = served.stop()
    assert code == 0, "the gateway did not stop cleanly"


@pytest.fixture(scope="module")
def tls_arena(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arena]:
    served = Arena(tmp_path_factory.mktemp("hostile-tls"), tls=True)
    served.start()
    try:
        yield served
    finally:
        code = served.stop()
    assert code == 0, "the TLS gateway did not stop cleanly"


def the_arena(request: pytest.FixtureRequest, name: str) -> Arena:
    fixture = "tls_arena" if name in TLS_ATTACKS else "arena"
    served: Arena = request.getfixturevalue(fixture)
    return served


def harmed(name: str, result: Measured) -> bool:
    """Whether the good producer looks harmed: slowed below the floor, or held past the deadline."""
    if name in DEADLINE_BOUND_S:
        return lost_time(result) > DEADLINE_BOUND_S[name] + DEADLINE_SLACK_S
    return result.pair_ratio < THROUGHPUT_RATIO


def lost_time(result: Measured) -> float:
    return statistics.median(result.attacked_elapsed) - statistics.median(result.base_elapsed)


async def attacked(served: Arena, name: str) -> Measured:
    """The attack measured ROUNDS times, and up to MORE_ROUNDS more while it looks harmful.

    A busy machine (other jobs on its two cores) can slow one half-second
    run by half; more pairs of runs then decide, by their medians. An attack
    that does starve the good producer does so in every pair, so the extra
    rounds cannot hide it (test_the_arena_measures_a_starved_producer_as_starved).
    """
    attacker = Attacker()

    async def once(rounds: int) -> Measured:
        return await measure(
            served,
            attacker,
            name,
            victim_stream(name),
            rounds=rounds,
            seconds=GOOD_SECONDS_FOR.get(name, GOOD_SECONDS),
            max_records=GOOD_RECORDS,
        )

    try:
        result = await once(ROUNDS)
        for _ in range(MORE_ROUNDS):
            if result.gateway_died or not harmed(name, result):
                break
            result.extend(await once(1))
        return result
    finally:
        await attacker.close()


@pytest.mark.parametrize("name", [name for name in ATTACKS if name not in BENCH_ONLY])
async def test_the_gateway_survives_the_attack_and_the_good_producer_is_unharmed(
    request: pytest.FixtureRequest, name: str
) -> None:
    served = the_arena(request, name)
    result = await attacked(served, name)
    print(
        f"\n{name}: good producer {result.attacked:,.0f} rec/s attacked, "
        f"{result.base:,.0f} alone (ratio {result.ratio:.2f}, by pairs {result.pair_ratio:.2f}), "
        f"lost {result.lost}, "
        f"gateway RssAnon +{(result.peak_memory - result.base_memory) / 1024:,.0f} KiB, "
        f"attacker: {result.answer()}, {result.seconds:.1f} s"
    )
    assert not result.gateway_died, "\n".join(result.problems)
    for report in result.reports:
        assert not report["exception"], report["exception"]
    assert result.problems == [], result.problems
    assert result.lost == 0
    assert result.failures == [], result.failures
    held = max(0, HELD_CONNECTIONS.get(name, 0) - 40)
    assert result.peak_memory - result.base_memory < MEMORY_BOUND + held * CONNECTION_MEMORY
    if name in DEADLINE_BOUND_S:
        assert not harmed(name, result), (
            f"the good producer was held {lost_time(result):.2f} s, beyond the deadline: "
            f"{result.attacked_elapsed} s attacked, {result.base_elapsed} s alone"
        )
    else:
        assert not harmed(name, result), (
            f"the good producer was starved (median ratio of pairs {result.pair_ratio:.2f}): "
            f"{result.attacked_rates} rec/s attacked, {result.base_rates} alone"
        )
    for report in result.reports:
        for got in report["errors"]:
            assert set(got) <= DOCUMENTED
            assert len(got) <= 1, "more than one Error before the close"
        check_offender(served, name, report, result.reports)


def codes(*names: ErrorCode) -> list[int]:
    return [int(code) for code in names]


def code_set(*names: ErrorCode) -> set[int]:
    return {int(code) for code in names}


#: What a peer that floods within the rules may get: nothing, or being cut off.
THROTTLED = code_set(ErrorCode.TIMEOUT, ErrorCode.RESOURCE_EXHAUSTED)


def connection_codes(report: dict[str, Any]) -> set[int]:
    return {code for got in report["errors"] for code in got}


def stream_dirs(served: Arena, prefix: str) -> list[Path]:
    streams = served.data / "streams"
    return [p for p in streams.iterdir() if p.name.startswith(prefix)] if streams.exists() else []


def stored_cost(data: Path, stream: str) -> int:
    """Log bytes the frames of ``stream`` take (0 if it was never created)."""
    directory = data / "streams" / stream
    if not directory.exists():
        return 0
    reader = LogReader.open(directory)
    try:
        frames = reader.read(reader.start_position(), reader.published_position())
        return sum(frame_cost(len(f.payload)) for f in frames)
    finally:
        reader.close()


def check_offender(
    served: Arena, name: str, report: dict[str, Any], reports: list[dict[str, Any]]
) -> None:
    errors: list[list[int]] = report["errors"]
    scoped = set(report["scoped_errors"])
    facts: dict[str, int] = report["facts"]
    cases: dict[str, list[int]] = report["cases"]
    connections = report["connections"]
    if name in ("random_frames", "mutated_frames"):
        # Anything goes in, one documented Error comes out, then the close.
        assert report["closed"] == connections
        assert sum(1 for got in errors if got) >= 0.9 * connections
    elif name in ("truncated_frames", "slowloris"):
        assert report["closed"] == connections
        assert errors == [codes(ErrorCode.TIMEOUT)] * connections
    elif name == "huge_lengths":
        assert report["closed"] == connections
        assert errors == [codes(ErrorCode.FRAME_TOO_LARGE)] * connections
    elif name == "bind_flood":
        # Binds beyond the guarantees are dropped (AnnounceDropping on channel
        # 0); binds of streams beyond the token's quota are refused one by one.
        # Binds are charged to the flood token's work budget, which may hold
        # the flood below its guarantees for the whole attack: then every
        # bind the gateway answered (refused, or bound) fit in them (each
        # takes at least 12 bytes: "h-flood-0-0" and its length).
        answered = len(report["scoped_errors"]) + len(stream_dirs(served, "h-flood"))
        assert 0 in report["dropping"] or answered * 12 <= facts["bind_guarantees"]
        assert scoped == code_set(ErrorCode.RESOURCE_EXHAUSTED)
        # A flooder that reads too little of the gateway's answers stops
        # being read, and is then cut off as idle.
        assert connection_codes(report) <= THROTTLED
        # Far beyond the guarantees: twice what they cover (binds of ~16 bytes).
        assert facts["binds_sent"] > 2 * facts["bind_guarantees"] // 16
        # The flood token's quota, not the gateway's limit, stopped it.
        assert 0 < len(stream_dirs(served, "h-flood")) <= 16
    elif name == "bad_frees":
        assert report["closed"] == connections
        assert errors == [
            codes(ErrorCode.UNKNOWN_HANDLE),
            codes(ErrorCode.UNKNOWN_HANDLE),
            codes(ErrorCode.UNKNOWN_HANDLE),
            codes(ErrorCode.HANDLE_FREED),
        ]
    elif name == "absolve_and_apologise":
        assert report["closed"] == connections
        assert errors == [
            codes(ErrorCode.ABSOLVED_TOO_MUCH),
            codes(ErrorCode.ABSOLVED_TOO_MUCH),
            codes(ErrorCode.UNEXPECTED_APOLOGY),
            codes(ErrorCode.UNEXPECTED_APOLOGY),
        ]
    elif name == "optimistic_never_apologised":
        assert 2 in report["dropping"]
        assert facts["batches_sent"] * 1000 > facts["guarantees"]
        # Stored: at most what the guarantees covered (this round's and the
        # rounds' before, all on the same stream); the rest was dropped.
        guaranteed = sum(r["facts"]["guarantees"] for r in reports)
        assert stored_cost(served.data, "h-optimist") <= guaranteed
    elif name == "never_reads":
        # Cut off; the Error may be lost with the unsent bytes of a peer that
        # does not read, so only its code is checked, when it arrives.
        assert report["closed"] == connections
        assert connection_codes(report) <= THROTTLED
    elif name == "max_sequence":
        # Each sequence skips ahead of the producer's next (0): refused, never acked.
        for case, got in cases.items():
            assert got, f"{case}: no Error"
            assert set(got) <= code_set(ErrorCode.OUT_OF_SEQUENCE, ErrorCode.MALFORMED_MESSAGE)
        assert facts.get("acked", 0) == 0
    elif name == "u64_fields":
        # Each case is answered: a Pong, or one documented Error and the close.
        assert facts.get("no_pong_and_open", 0) == 0
        for case, got in cases.items():
            assert set(got) <= DOCUMENTED, case
            if case in ("Hello.producer_id=2^63", "Hello.producer_id=2^64-1"):
                assert got == codes(ErrorCode.BAD_HELLO)
    elif name in ("spoof_empty_batch", "spoof_forged_record"):
        # The victim's id belongs to the victim's token: the bind is fenced.
        assert int(ErrorCode.PRODUCER_FENCED) in scoped
        assert facts.get("acked_forgery", 0) == 0
        assert facts.get("acked_handles", 0) == 0
    elif name == "sequence_gap":
        assert report["closed"] == connections == 1
        assert errors == [codes(ErrorCode.OUT_OF_SEQUENCE)]
        assert facts["acked_beyond_gap"] == 0
    elif name in (
        "list_streams_flood",
        "absolve_zero_flood",
        "many_handles",
        "dilute_shares",
        "fetch_tiny_frames",
        "ping_flood_60",
        "ping_flood_4",
        "empty_frame_flood",
        "subscribe_flood",
    ):
        # Charged and throttled; at most cut off, or a handle refused at a cap.
        assert connection_codes(report) <= THROTTLED
        assert scoped <= code_set(ErrorCode.RESOURCE_EXHAUSTED)
    elif name in ("noisy_writers_16", "noisy_writers_4"):
        # Valid data within guarantees: nothing is refused, and the writers
        # did write (the turn of their token per pass is what holds them to
        # their share); a writer left idle while it waited for credit is cut off.
        assert not scoped
        assert connection_codes(report) <= code_set(ErrorCode.TIMEOUT)
        assert facts["acked"] > 0
    elif name == "plead_ignored":
        # Past plead_deadline_ms (in Welcome) a writer that ignores a Plead is
        # closed with TIMEOUT; idle after the attack, it is closed as well.
        assert report["closed"] == connections
        assert errors == [codes(ErrorCode.TIMEOUT)] * connections
        # Writers pleaded long before the end were closed under attack. (Not
        # every hog is pleaded: credit follows use, and one that holds no
        # more than its share is asked for nothing; and a Plead is withdrawn
        # when the writer's share rises back, say when the other hogs are
        # closed. So at least one, not all; the exact rule is tested in
        # tests/gateway/test_sharing.py.)
        if facts["pleaded_past_deadline"]:
            assert facts["closed_under_attack"] >= 1
    elif name == "reader_slots":
        # Readers beyond their share of the slots are refused; the good
        # producer still connected (checked by its failures and its rate).
        assert connection_codes(report) <= code_set(ErrorCode.RESOURCE_EXHAUSTED)
    elif name == "forbidden_bind_flood":
        assert int(ErrorCode.FORBIDDEN) in scoped
        assert scoped <= code_set(ErrorCode.FORBIDDEN, ErrorCode.RESOURCE_EXHAUSTED)
        assert connection_codes(report) <= THROTTLED
    elif name == "tls_handshake_flood":
        assert facts.get("handshakes", 0) + facts.get("refused", 0) > 0
    elif name in ("drip_frames", "slowloris_half_frame"):
        # A frame that has started must finish within the frame deadline; a
        # trickle that beats the idle timeout does not keep it open.
        assert report["closed"] == connections
        assert errors == [codes(ErrorCode.TIMEOUT)] * connections
    elif name == "free_gateway_handle":
        # The gateway's own handle: refused with an Error, never confirmed.
        assert facts["confirmed_free"] == 0
        assert report["closed"] == connections
        assert all(len(got) == 1 for got in errors), errors
    else:
        raise AssertionError(f"no offender check for {name}")


def test_only_the_named_open_problems_are_left_to_the_bench() -> None:
    """The suite leaves out no attack silently: only those named, with why."""
    assert set(BENCH_ONLY) == set()
    assert set(BENCH_ONLY) <= set(ATTACKS)
    assert all(reason for reason in BENCH_ONLY.values())


def test_every_attack_has_an_offender_check() -> None:
    """A new attack without a check of its answer fails here, not silently."""
    source = Path(__file__).read_text()
    for name in ATTACKS:
        assert f'"{name}"' in source, name


def test_the_arena_measures_a_starved_producer_as_starved(tmp_path: Path) -> None:
    """The ratio check can fail: a producer shut out of the gateway measures near 0."""

    async def starved() -> float:
        served = Arena(tmp_path)
        served.start()
        try:
            assert served.proc is not None
            served.proc.send_signal(signal.SIGSTOP)  # the gateway answers nothing
            run = await asyncio.wait_for(good_run(served, "g-starved", 0, 0.3, 1000), 30)
            served.proc.send_signal(signal.SIGCONT)
            return run.rate
        finally:
            served.stop()

    assert asyncio.run(starved()) == 0.0
