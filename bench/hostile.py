"""Benchmark: what each hostile peer costs a good producer, beside its own baseline.

    .venv/bin/python bench/hostile.py                      # every attack, ~5 minutes
    .venv/bin/python bench/hostile.py --attack ping_flood_60 --rounds 3
    .venv/bin/python bench/hostile.py --list

One ``headgate serve`` subprocess (a tokens file and small limits, the same
configuration as the hostile test suite: ``tests/hostile/harness.py``), plus a
second one with TLS for the TLS attack. For each attack in
``tests/hostile/attacks.py`` a good producer sends 100-byte records on a stream
of its own, alternately alone and under attack (A B A B ...: interleaved, so
a machine that is busy for other reasons slows both alike). Per attack:

* ``alone``, ``attacked``: the medians of the good producer's acked records/s;
* ``ratio``: attacked over alone (target: at least 0.9);
* ``gateway cores alone / attacked``, ``attacker cores``: the medians of the
  CPU the gateway used (seconds per wall second) during the runs alone and
  attacked, and of what the attack worker used during the attacked runs. On
  a machine with fewer cores than the three processes, a ratio under 0.9
  with the gateway's cores no higher attacked than alone points at the
  attacker's own CPU, not at the gateway's time spent on it;
* ``lost``: records the gateway acknowledged and did not store (0 expected),
  and whether the stored records were exactly the good producer's, in order;
* ``attacker's answer``: what the attacker was told (Error codes, closes).

Exits non-zero if the gateway died in any attack (it is restarted, with fresh
data, for the next one).

``--cpu-per-batch`` measures something else: each named attack that counts
the batches it had acknowledged (the noisy writers) runs alone, with no good
producer, for ``--seconds`` at a time (``--rounds`` times), and the gateway's
CPU seconds (all its threads, user and system) per 1,000 of those batches
are printed. Unlike a ratio, CPU per batch means something on a busy machine
too: it is what a fair split of the gateway's time has to work with.

    .venv/bin/python bench/hostile.py --cpu-per-batch --attack noisy_writers_16 --seconds 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the attacks live with the hostile tests

from tests.hostile.attacks import ATTACKS, CONTROLS  # noqa: E402
from tests.hostile.harness import (  # noqa: E402
    TLS_ATTACKS,
    Arena,
    Attacker,
    Measured,
    capacity_for,
    measure,
    victim_stream,
)

TARGET_RATIO = 0.9
#: Above the good producer's rate here (about 1M records/s): a run's cap.
MOST_RECORDS_PER_S = 2_500_000


def row(result: Measured) -> str:
    met = "yes" if result.ratio >= TARGET_RATIO else "NO"
    died = " GATEWAY DIED" if result.gateway_died else ""
    order = " (records wrong)" if result.mismatched else ""
    return (
        f"| {result.name} | {result.base:,.0f} | {result.attacked:,.0f} | {result.ratio:.2f} "
        f"| {met} | {result.cores()} | {result.lost}{order} | {result.answer()}{died} |"
    )


async def run(
    names: list[str], rounds: int, seconds: float, keep: Path | None, verbose: bool
) -> int:
    with contextlib.ExitStack() as stack:
        if keep is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="headgate-hostile-"))
        else:
            tmp = str(keep)
        # Big enough that a good run is not cut short by the records that
        # fit in the stream (harness.records_that_fit).
        most = int(seconds * MOST_RECORDS_PER_S)
        capacity = max(256, capacity_for(most))
        plain = Arena(Path(tmp) / "plain", capacity_mib=capacity)
        tls = Arena(Path(tmp) / "tls", capacity_mib=capacity, tls=True)
        attacker = Attacker()
        results: list[Measured] = []
        print(
            f"{len(names)} attacks, {rounds} rounds of {seconds:g} s alone and attacked each",
            flush=True,
        )
        print(
            "| attack | alone rec/s | attacked rec/s | ratio | >= 0.9 "
            "| gateway cores alone / attacked | attacker cores | lost | attacker's answer |"
        )
        print("|---|---:|---:|---:|---|---:|---:|---:|---|", flush=True)
        try:
            for name in names:
                arena = tls if name in TLS_ATTACKS else plain
                result = await measure(
                    arena,
                    attacker,
                    name,
                    victim_stream(name),
                    rounds=rounds,
                    seconds=seconds,
                    max_records=most,
                )
                results.append(result)
                print(row(result), flush=True)
                for problem in result.problems + result.failures:
                    print(f"|   | {problem} |", flush=True)
                for report in result.reports:
                    if verbose:
                        print(f"|   | facts {report['facts']} cases {report['cases']} |")
                    if report.get("exception"):
                        print(f"|   | attack failed: {report['exception'][-300:]!r} |", flush=True)
        finally:
            await attacker.close()
            codes = [plain.stop(), tls.stop()]
            for arena in (plain, tls):
                if arena.deaths or codes[0 if arena is plain else 1] not in (0, None):
                    print(f"gateway log ({arena.root}):\n{arena.log_tail()}")
        attacked = [r for r in results if r.name not in CONTROLS]
        met = sum(r.ratio >= TARGET_RATIO for r in attacked)
        died = [r.name for r in results if r.gateway_died]
        print(f"\n{met}/{len(attacked)} attacks at or above {TARGET_RATIO} of the baseline")
        controls = [f"{r.ratio:.2f}" for r in results if r.name in CONTROLS]
        if controls:
            print(f"controls (nothing attacks; the measurement's own noise): {', '.join(controls)}")
        print(f"records lost: {sum(r.lost for r in results)}")
        if died or plain.deaths or tls.deaths:
            print(f"the gateway died in: {', '.join(died)}")
            return 1
        if any(code not in (0, None) for code in codes):
            print(f"the gateway did not stop cleanly: {codes}")
            return 1
        return 0


async def cpu_per_batch(names: list[str], rounds: int, seconds: float) -> int:
    """The gateway's CPU per 1,000 acknowledged batches of each attack, run alone."""
    print("| attack | batches/s | gateway CPU s per 1,000 batches | load (1 min) |")
    print("|---|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory(prefix="headgate-hostile-cpu-") as tmp:
        arena = Arena(Path(tmp), capacity_mib=256)
        attacker = Attacker()
        try:
            for name in names:
                for _ in range(rounds):
                    arena.ensure_up()
                    cpu, wall = arena.cpu(), time.monotonic()
                    await attacker.start(name, arena.target())
                    await asyncio.sleep(seconds)
                    report = await attacker.stop()
                    cpu, wall = arena.cpu() - cpu, time.monotonic() - wall
                    batches = report["facts"].get("batches")
                    if not batches:
                        print(f"| {name} | (counts no batches) | | |", flush=True)
                        break
                    print(
                        f"| {name} | {batches / wall:,.0f} | {1000 * cpu / batches:.4f} "
                        f"| {os.getloadavg()[0]:.1f} |",
                        flush=True,
                    )
        finally:
            await attacker.close()
            arena.stop()
    return 0


def default_names(control: bool) -> list[str]:
    """Every attack; with ``control``, the control at the start, the middle and the end."""
    names = list(ATTACKS)
    if not control:
        return names
    half = len(names) // 2
    return ["no_attack", *names[:half], "no_attack", *names[half:], "no_attack"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Each hostile attack against a served gateway, with a good producer's "
        "throughput alone and under attack (interleaved), records lost, and the "
        "attacker's answer. Exits 1 if the gateway died.",
    )
    parser.add_argument(
        "--attack",
        action="append",
        choices=[*ATTACKS, *CONTROLS],
        metavar="NAME",
        help="run only this attack (repeatable; --list shows the names)",
    )
    parser.add_argument(
        "--no-control",
        action="store_true",
        help="without --attack, skip the three control rows (no_attack: nothing "
        "attacks, measured like an attack, at the start, the middle and the end)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs per attack (default 2)")
    parser.add_argument(
        "--seconds",
        type=float,
        default=1.0,
        help="length of each good-producer run, alone or attacked (default 1.0)",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="keep the gateways' data and logs in DIR (a temporary directory by default)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print each attack's facts and cases too"
    )
    parser.add_argument("--list", action="store_true", help="list the attacks and exit")
    parser.add_argument(
        "--cpu-per-batch",
        action="store_true",
        help="instead: the gateway's CPU per 1,000 acknowledged batches of each attack "
        "run alone (default: the noisy writers)",
    )
    args = parser.parse_args()
    if args.list:
        for name, attack in {**ATTACKS, **CONTROLS}.items():
            print(f"{name:28} {(attack.__doc__ or '').splitlines()[0]}")
        return
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds must be at least 1 and --seconds positive")
    if args.cpu_per_batch:
        names = args.attack or ["noisy_writers_16", "noisy_writers_4"]
        sys.exit(asyncio.run(cpu_per_batch(names, args.rounds, args.seconds)))
    sys.exit(
        asyncio.run(
            run(
                args.attack or default_names(control=not args.no_control),
                args.rounds,
                args.seconds,
                args.keep,
                args.verbose,
            )
        )
    )


if __name__ == "__main__":
    main()
