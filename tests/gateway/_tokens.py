"""One way for tests to write a gateway's tokens file (see ``headgate.gateway.auth``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from headgate.gateway.auth import hash_token


@dataclass(frozen=True)
class Token:
    """One ``[[token]]`` table: a name, the secret the client presents, its rights."""

    name: str
    secret: str
    write: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    consume: tuple[str, ...] = ()
    admin: bool = False
    max_streams: int | None = None

    def toml(self) -> str:
        lines = [
            "[[token]]",
            f"name = {json.dumps(self.name)}",
            f'sha256 = "{hash_token(self.secret.encode())}"',
        ]
        if self.write:
            lines.append(f"write = {json.dumps(list(self.write))}")
        if self.read:
            lines.append(f"read = {json.dumps(list(self.read))}")
        if self.consume:
            lines.append(f"consume = {json.dumps(list(self.consume))}")
        if self.admin:
            lines.append("admin = true")
        if self.max_streams is not None:
            lines.append(f"max_streams = {self.max_streams}")
        return "\n".join(lines) + "\n"


def write_tokens(path: Path, *tokens: Token) -> Path:
    """Write ``tokens`` as a tokens file at ``path``; return the path."""
    path.write_text("\n".join(token.toml() for token in tokens))
    return path
