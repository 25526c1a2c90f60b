"""``headgate token``: a new random token, and the tokens-file entry that admits it."""

from __future__ import annotations

import click


@click.command()
@click.option("--name", default="producer", show_default=True, help="Shown in gateway logs.")
@click.option(
    "--write", "write", multiple=True, help="Stream pattern it may write (repeatable): 'sensor-*'."
)
@click.option("--read", "read", multiple=True, help="Stream pattern it may read (repeatable).")
@click.option("--admin", is_flag=True, help="May release positions and change settings.")
def token(name: str, write: tuple[str, ...], read: tuple[str, ...], admin: bool) -> None:
    """Make a new random token and print the tokens-file entry for it.

    The token itself goes to stderr, once: give it to the producer (for
    example as HEADGATE_TOKEN). Only its SHA-256 goes to stdout, as a
    [[token]] table to append to the gateway's tokens file (--auth-file).
    """
    import json

    from headgate.gateway.auth import generate_token, hash_token

    secret = generate_token()
    click.echo(f"token (keep it secret, it is shown only now): {secret}", err=True)
    lines = [
        "[[token]]",
        f"name = {json.dumps(name)}",
        f'sha256 = "{hash_token(secret.encode())}"',
        f"write = {json.dumps(list(write))}",
        f"read = {json.dumps(list(read))}",
        f"admin = {'true' if admin else 'false'}",
    ]
    click.echo("\n".join(lines))
