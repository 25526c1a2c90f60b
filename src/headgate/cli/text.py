"""How the commands write what several of them show: sizes, counts, a busy directory."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headgate.log.lock import DirectoryInUse


def bytes_text(n: int) -> str:
    """``n`` bytes for people: 512 B, 1.5 KiB, 3.0 GiB."""
    if n < 1024:
        return f"{n:,} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:,.1f} {unit}"


def count_text(count: int | None) -> str:
    """A count of records for a table; ``?`` where the gateway could not count them."""
    return "?" if count is None else f"{count:,}"


def in_use(exc: DirectoryInUse) -> str:
    """The one line that says a data directory has its gateway already, and what to do."""
    holder = "another gateway" if exc.pid is None else f"another gateway (pid {exc.pid})"
    return (
        f"the data directory {exc.directory} is in use by {holder}; "
        "stop it or choose another --data-dir"
    )
