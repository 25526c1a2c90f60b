"""Reading headgate's TOML files, and the mistakes every one of them can hold.

Four files are written by hand: the gateway's config file, its tokens file,
a cluster file and a pipeline file. Each loader checks its own keys and
values, but reading the file, parsing it and refusing a key or a table that
does not belong happen the same way in all four, here, so that the same
mistake reads the same in each: one line, naming the file (and, below its
top, the table) and what is wrong.

The helpers raise the error class the caller gives (``ConfigError``, or a
subclass such as ``ClusterError``), so each loader keeps its own exception.
This module imports nothing of headgate, so that ``config`` itself can use it.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

__all__ = ["expect_table", "read_toml", "refuse_unknown"]

#: A set of known keys longer than this is not listed in an error (it would
#: hide the answer); the nearest known names are suggested instead.
_MOST_LISTED = 20


def read_toml(path: Path, kind: str, error: type[ValueError]) -> dict[str, Any]:
    """The parsed TOML document at ``path``; ``kind`` names the file in errors.

    ``kind`` is the file's role, as in "config", "tokens", "cluster" or
    "pipeline": a missing file reads "pipeline file P does not exist".

    Raises:
        error: the file is missing, a directory, unreadable, not UTF-8, or
            not valid TOML; the message is one line and names ``path``.
    """
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{kind} file {path} does not exist") from None
    except IsADirectoryError:
        raise error(f"{path} is a directory, not a {kind} file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {kind} file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path}: not valid TOML: {exc}") from None


def refuse_unknown(
    found: Collection[object],
    known: Collection[str],
    where: str,
    error: type[ValueError],
    *,
    noun: str = "key",
    hint: str = "",
) -> None:
    """Refuse the names in ``found`` that are not ``known``, all of them in one error.

    The message is ``WHERE: unknown key(s) A, B (known: ...)``: a sequence
    of known names is listed in its own order (the order the docs give), any
    other collection sorted; past 20 names, only the nearest to each unknown
    one. ``noun`` says what the names are ("key", "section"); ``hint`` is
    appended as it is (e.g. "; use [[token]]").
    """
    unknown = sorted({str(name) for name in found} - set(known))
    if not unknown:
        return
    names = list(known) if isinstance(known, Sequence) else sorted(known)
    if len(names) <= _MOST_LISTED:
        help_text = f" (known: {', '.join(names)})"
    else:
        near = sorted({m for u in unknown for m in difflib.get_close_matches(u, names, n=2)})
        help_text = f" (did you mean {' or '.join(near)}?)" if near else ""
    raise error(f"{where}: unknown {noun}(s) {', '.join(unknown)}{help_text}{hint}")


def expect_table(
    value: object, where: str, error: type[ValueError], shape: str = "a table"
) -> dict[str, Any]:
    """``value`` if it is a TOML table, else ``error("WHERE must be SHAPE")``.

    ``shape`` says what was expected, for the reader who wrote something
    else: "a table of tables", "a table with an address".
    """
    if not isinstance(value, dict):
        raise error(f"{where} must be {shape}")
    return value
