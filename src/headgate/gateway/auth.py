"""Who may do what: tokens, stored hashed, mapped to rights on streams.

A token file is TOML with one ``[[token]]`` table per token::

    [[token]]
    name = "ingest"                 # shown in logs instead of the token
    sha256 = "3f0a...64 hex digits" # headgate token prints this line
    write = ["clicks", "sensor-*"]  # fnmatch patterns of writable streams
    read = ["clicks"]               # tail subscriptions and Spark Fetch
    consume = ["clicks/archive"]    # "stream/consumer" patterns: Release and
                                    # DeclareConsumer of those consumers
    admin = false                   # Release and declare of any consumer, runtime changes
    max_streams = 100               # new streams it may create (optional)

The gateway never sees a token at rest, only its SHA-256. A plain hash and
not a slow KDF (scrypt, PBKDF2) is deliberate: ``headgate token`` makes
tokens of 256 random bits, which no hash speed makes guessable, while a slow
KDF would let any peer make the gateway burn tens of milliseconds of CPU per
Hello. A hand-written token must be as random for the same to hold, so the
loader refuses tokens files that are not hex digests and the README says so.

:meth:`TokenTable.authenticate` compares the presented token's digest with
every stored digest using :func:`hmac.compare_digest` and never stops early,
so its time does not depend on which entry matches or how much of a digest
does.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headgate.config import ConfigError
from headgate.tomlfile import expect_table, read_toml, refuse_unknown

__all__ = [
    "ALL_RIGHTS",
    "Rights",
    "TokenTable",
    "generate_token",
    "hash_token",
    "load_tokens",
]

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_KEYS = {"name", "sha256", "write", "read", "consume", "admin", "max_streams"}


@dataclass(frozen=True, slots=True)
class Rights:
    """What one authenticated peer may do.

    Patterns are ``fnmatch`` patterns matched case-sensitively against the
    whole stream name (``"*"`` is every stream, ``"sensor-*"`` a prefix).
    """

    #: The token's name from the tokens file (never the token), for logs.
    name: str
    #: Patterns of streams the peer may bind and append to.
    write: tuple[str, ...] = ()
    #: Patterns of streams the peer may tail or fetch.
    read: tuple[str, ...] = ()
    #: Patterns of ``stream/consumer`` the peer may Release and declare.
    consume: tuple[str, ...] = ()
    #: Whether the peer may release stream positions and change settings.
    admin: bool = False
    #: How many new streams the token's peers may create, together; None for
    #: the gateway's ``streams_per_token``.
    max_streams: int | None = None

    def can_write(self, stream: str) -> bool:
        """Whether the peer may bind ``stream`` and append records to it."""
        return any(fnmatch.fnmatchcase(stream, p) for p in self.write)

    def can_read(self, stream: str) -> bool:
        """Whether the peer may subscribe to or fetch ``stream``."""
        return any(fnmatch.fnmatchcase(stream, p) for p in self.read)

    def can_consume(self, stream: str, consumer: str) -> bool:
        """Whether the peer may Release (and declare) ``consumer`` of ``stream``.

        The ``admin`` right covers every consumer; a ``consume`` pattern
        covers those whose ``stream/consumer`` it matches.
        """
        key = f"{stream}/{consumer}"
        return self.admin or any(fnmatch.fnmatchcase(key, p) for p in self.consume)

    def can_administer(self) -> bool:
        """Whether the peer may Release positions and change runtime settings."""
        return self.admin


#: The rights of every peer when the gateway has no tokens file.
ALL_RIGHTS = Rights(name="anyone", write=("*",), read=("*",), admin=True)


def hash_token(token: bytes) -> str:
    """The hex SHA-256 of a token, as the tokens file stores it."""
    return hashlib.sha256(token).hexdigest()


def generate_token() -> str:
    """A new token: 256 random bits, URL-safe text (43 characters)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    rights: Rights


class TokenTable:
    """The tokens a gateway accepts and the rights of each."""

    def __init__(self, entries: list[tuple[str, Rights]]) -> None:
        self._entries = [
            _Entry(digest=bytes.fromhex(hexdigest), rights=rights) for hexdigest, rights in entries
        ]
        # Compared against when nothing is configured, so an empty table
        # costs the same time as a one-entry table.
        self._decoy = hashlib.sha256(b"headgate-decoy").digest()

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, token: bytes) -> Rights | None:
        """The rights of ``token``, or None if it is not a known token."""
        digest = hashlib.sha256(token).digest()
        found: Rights | None = None
        if not self._entries:
            hmac.compare_digest(digest, self._decoy)
        for entry in self._entries:
            # No early exit: every entry is compared whatever matches.
            if hmac.compare_digest(digest, entry.digest) and found is None:
                found = entry.rights
        if not token:
            return None
        return found


def _patterns(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(f"{what}: expected a list of stream name patterns, got {value!r}")
    return tuple(value)


def _consume_patterns(value: Any, what: str) -> tuple[str, ...]:
    patterns = _patterns(value, what)
    for pattern in patterns:
        if "/" not in pattern:
            raise ConfigError(
                f'{what}: {pattern!r} names no consumer; use "stream/consumer" '
                '(patterns allowed on both sides, e.g. "clicks/*")'
            )
    return patterns


def load_tokens(path: Path) -> TokenTable:
    """Read a tokens file; errors name the file, the entry and the key."""
    raw = read_toml(path, "tokens", ConfigError)
    refuse_unknown(raw, ("token",), str(path), ConfigError, hint="; use [[token]]")
    tables = raw.get("token", [])
    if not isinstance(tables, list):
        raise ConfigError(f"{path}: token must be an array of tables ([[token]])")
    entries: list[tuple[str, Rights]] = []
    seen: set[str] = set()
    for index, table in enumerate(tables):
        where = f"{path}: token #{index + 1}"
        table = expect_table(table, where, ConfigError)
        refuse_unknown(table, _KEYS, where, ConfigError)
        name = table.get("name", f"token-{index + 1}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: expected a non-empty string")
        digest = table.get("sha256")
        if not isinstance(digest, str) or not _HEX64.match(digest.lower()):
            raise ConfigError(
                f"{where} ({name}).sha256: expected 64 hex digits (the output of "
                "`headgate token`), not the token itself"
            )
        digest = digest.lower()
        if digest in seen:
            raise ConfigError(f"{where} ({name}): the same token hash appears twice")
        seen.add(digest)
        admin = table.get("admin", False)
        if not isinstance(admin, bool):
            raise ConfigError(f"{where} ({name}).admin: expected true or false")
        max_streams = table.get("max_streams")
        if max_streams is not None and (
            isinstance(max_streams, bool) or not isinstance(max_streams, int) or max_streams < 0
        ):
            raise ConfigError(f"{where} ({name}).max_streams: expected a whole number >= 0")
        rights = Rights(
            name=name,
            write=_patterns(table.get("write", []), f"{where} ({name}).write"),
            read=_patterns(table.get("read", []), f"{where} ({name}).read"),
            consume=_consume_patterns(table.get("consume", []), f"{where} ({name}).consume"),
            admin=admin,
            max_streams=max_streams,
        )
        entries.append((digest, rights))
    return TokenTable(entries)
