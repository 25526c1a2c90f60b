"""Who owns a producer id: whoever first wrote with it (DESIGN.md, "Identity").

The gateway deduplicates a stream's batches by producer id and sequence. If
any peer could write under any id, it could make the gateway take a victim's
next records for duplicates (acknowledged, never stored) or store its own
records in their place. So an id belongs to its first writer, as Kafka's
broker assigns producer ids and fences other epochs:

* with a tokens file, to the token's *name* (the rights it stands for; a
  token replaced under the same name keeps its ids, a renamed one does not);
* without one, to the holder of a *secret*. The gateway gives every peer
  that says Hello without a secret a new random one in Welcome; a producer
  presents it in the Hello of each later connection (and a spool can keep it
  with the id, to resume after a restart). Only its SHA-256 is kept.

A peer is tied to an id lazily, when its connection first binds a stream for
writing: readers, release clients and tails say Hello with some id too, and
neither claim it nor are refused for it. A bind under an id that another
owner holds is refused, scoped to that stream, with ``PRODUCER_FENCED``.

The table is durable, so a restart does not free the ids: the file
``state/producers.log`` in the data directory has one line per claim::

    <producer id, decimal> <owner>\\n

    owner:  token:<the token's name, as a JSON string>
         |  secret:<the secret's SHA-256, 64 hex digits>

A claim is appended (one small write per new id, never a rewrite of the
table) before its bind is accepted, and made durable off the event loop by
the group commit (:meth:`ProducerOwners.sync`, in its thread), which fsyncs
the table before it syncs the stream logs, and again after them if a claim
came in meanwhile. Nothing is acknowledged under an id before a group commit
has ended, so the claim is durable before anything acknowledged under it:
the crash rule of the earlier fsync on the loop (where a new id cost every
connection an fsync of latency), without the wait. A connection claims at
most once (its first bind), so what a peer can make of that is bounded by the
connections it may open and the budgets that charge Hellos, binds and each
new claim (``Cost.CLAIM``), and in all by ``max_producer_ids``. Ids already
known cost nothing. A last line without its newline is a claim a crash tore
(and a claim not yet fsynced may be lost whole): nothing was acknowledged
under it, so it is dropped. Any other damage stops the gateway at start with a clear error, as
a broken stream log does: guessing would hand ids to whoever asks first.
A data directory from before this table has none: its ids are claimed anew,
by their first writer after the upgrade.

The table holds at most ``max_producer_ids`` ids (the file about 100 bytes
per id, memory about twice that); a claim beyond it is refused with
``RESOURCE_EXHAUSTED``, scoped to the stream. Ids are never forgotten.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
from pathlib import Path

from headgate.log import LogError
from headgate.protocol.errors import ErrorCode, ProtocolError

__all__ = ["SECRET_BYTES", "ProducerOwners", "hello_owner"]

#: Bytes of a secret the gateway issues in Welcome (128 random bits).
SECRET_BYTES = 16

_LINE = re.compile(r"(0|[1-9][0-9]{0,19}) (token:\".*\"|secret:[0-9a-f]{64})")


def hello_owner(token_name: str | None, secret: bytes) -> tuple[str, bytes]:
    """Who a peer is, as an owner of producer ids, and the secret its Welcome carries.

    Args:
        token_name: the name of the peer's token; None without a tokens file.
        secret: the Hello's secret (empty on a producer's first connection).

    With a token the token is the owner and Welcome carries no secret. Without
    one, an empty secret gets a new random secret, and a presented one is
    echoed back. The owner string never contains a secret or a token, only
    a token's name or a secret's SHA-256.
    """
    if token_name is not None:
        # Quoted, so that no name (a newline in a TOML string) can break a line.
        return f"token:{json.dumps(token_name)}", b""
    if not secret:
        secret = secrets.token_bytes(SECRET_BYTES)
    return f"secret:{hashlib.sha256(secret).hexdigest()}", secret


class ProducerOwners:
    """The durable table of producer ids and their owners. Create with :meth:`open`."""

    def __init__(self, path: Path, owners: dict[int, str], *, limit: int) -> None:
        self.path = path
        self._owners = owners
        self._limit = limit
        # Claims appended (on the loop), and how many of them an fsync made
        # durable (in the group commit's thread): plain counters, each
        # written by one side only.
        self._written = 0
        self._synced = 0
        self._directory_unsynced = False

    @classmethod
    def open(cls, path: Path, *, limit: int) -> ProducerOwners:
        """Read the table at ``path`` (none yet: empty).

        Raises:
            LogError: the file is damaged (other than a torn last line).
        """
        owners: dict[int, str] = {}
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls(path, owners, limit=limit)
        except OSError as exc:
            raise LogError(f"producer ids table {path} is unreadable: {exc}") from exc
        lines = data.split(b"\n")
        torn = lines.pop()  # after the last newline: empty, or a torn claim
        for number, raw in enumerate(lines, 1):
            match = None
            with contextlib.suppress(UnicodeDecodeError):
                match = _LINE.fullmatch(raw.decode("utf-8"))
            if match is None:
                raise LogError(
                    f"producer ids table {path} is damaged at line {number}: {raw[:80]!r}; "
                    "restore it from a backup (deleting it lets any peer claim any id)"
                )
            producer_id, owner = int(match[1]), match[2]
            if owners.setdefault(producer_id, owner) != owner:
                raise LogError(
                    f"producer ids table {path} is damaged at line {number}: "
                    f"producer id {producer_id} has two owners"
                )
        if torn:
            # Never acknowledged (its bind waited for the fsync): drop it, so
            # that the next claim starts on a line of its own.
            with open(path, "r+b") as f:
                f.truncate(len(data) - len(torn))
                os.fsync(f.fileno())
        return cls(path, owners, limit=limit)

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, producer_id: int) -> str | None:
        """The owner of ``producer_id``, or None while nobody has written with it."""
        return self._owners.get(producer_id)

    def claim(self, producer_id: int, owner: str) -> ProtocolError | None:
        """Tie ``producer_id`` to ``owner`` if it is free; why the bind is refused if not.

        None when ``owner`` owns the id (from before, or from now: the claim
        is then written, and durable after the next :meth:`sync`, which every
        group commit runs before any Ack goes out). Otherwise the error to scope to
        the stream: ``PRODUCER_FENCED`` when another owner holds the id (the
        text names the id, never a secret), ``RESOURCE_EXHAUSTED`` when the
        table is full, ``STORAGE_UNAVAILABLE`` when the claim cannot be written.
        """
        held = self._owners.get(producer_id)
        if held == owner:
            return None
        if held is not None:
            how = (
                "another token"
                if held.startswith("token:")
                else "another producer (present its secret in Hello)"
            )
            return ProtocolError(
                f"producer id {producer_id} belongs to {how}; nothing is stored under it "
                "for this connection",
                code=ErrorCode.PRODUCER_FENCED,
            )
        if len(self._owners) >= self._limit:
            return ProtocolError(
                f"the gateway holds its maximum of {self._limit} producer ids "
                f"(max_producer_ids); producer id {producer_id} is new",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        try:
            self._append(f"{producer_id} {owner}\n".encode())
        except OSError as exc:
            return ProtocolError(
                f"cannot record producer id {producer_id}: {os.strerror(exc.errno or 0)}",
                code=ErrorCode.STORAGE_UNAVAILABLE,
            )
        self._owners[producer_id] = owner
        self._written += 1
        return None

    @property
    def durable(self) -> bool:
        """Whether every claim written so far has been made durable."""
        return self._synced >= self._written

    def sync(self) -> None:
        """Make every claim written so far durable (an fsync; from any thread).

        Nothing to do (no fsync) when no claim was written since the last one.

        Raises:
            OSError: the fsync failed; the claims count as not durable, and
                the next sync tries again.
        """
        target = self._written
        if self._synced >= target:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if self._directory_unsynced:
            # The file's directory entry must survive a crash as well.
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            self._directory_unsynced = False
        self._synced = target

    def _append(self, line: bytes) -> None:
        new = not self.path.exists()
        if new:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._directory_unsynced = True
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            try:
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(errno.ENOSPC, "short write")
            except OSError:
                # Leave no partial claim behind to be read as damage.
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
