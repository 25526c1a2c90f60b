"""The options several commands share: where the gateway is, how to reach it, what to print.

``send``, ``tail``, ``consumers``, ``streams`` and ``cluster status`` take the
same ``--gateway`` and the same token and TLS options, with the same help and
the same usage errors, so both are written once here; so is the ``--format
table|json`` of the commands that print tables.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from headgate.config import DEFAULT_PORT

if TYPE_CHECKING:
    from headgate.client.security import ClientSecurity

F = TypeVar("F", bound=Callable[..., Any])

SECURITY_OPTIONS = ("token", "tls", "ca_file", "cert", "key", "server_name")


#: Where a client command finds the gateway (send, tail).
gateway_option = click.option(
    "--gateway",
    default=f"127.0.0.1:{DEFAULT_PORT}",
    show_default=True,
    help="host:port, or unix:PATH for the gateway's Unix socket.",
)


def security_options(command: F) -> F:
    """The token and TLS options every client command takes (send, tail)."""
    file = click.Path(exists=True, dir_okay=False, path_type=Path)
    for option in reversed(
        (
            click.option(
                "--token",
                envvar="HEADGATE_TOKEN",
                help="Authentication token (or set HEADGATE_TOKEN, which keeps it out of `ps`).",
            ),
            click.option(
                "--tls", is_flag=True, help="Use TLS; the gateway's certificate is verified."
            ),
            click.option(
                "--ca-file",
                type=file,
                help="CA bundle to verify the gateway with (implies --tls; default: the system's).",
            ),
            click.option(
                "--cert", type=file, help="Client certificate for mutual TLS (implies --tls)."
            ),
            click.option("--key", type=file, help="Its key."),
            click.option(
                "--server-name", help="Name the gateway's certificate must carry (default: host)."
            ),
        )
    ):
        command = option(command)
    return command


def client_security(options: dict[str, Any]) -> ClientSecurity:
    """The :class:`ClientSecurity` of the options ``security_options`` added; usage errors."""
    from headgate.client.security import ClientSecurity, SecurityError

    values = {name: options.pop(name) for name in SECURITY_OPTIONS}
    token = values["token"]
    try:
        security = ClientSecurity(
            token=token.encode() if token else None,
            tls=values["tls"],
            ca_file=None if values["ca_file"] is None else str(values["ca_file"]),
            cert_file=None if values["cert"] is None else str(values["cert"]),
            key_file=None if values["key"] is None else str(values["key"]),
            server_name=values["server_name"],
        )
        security.ssl_context()  # files that cannot be loaded are usage errors
    except SecurityError as exc:
        message = str(exc).replace(
            "a client key needs its certificate (cert_file)", "--key needs --cert"
        )
        raise click.UsageError(message) from None
    return security


def table_or_json(help_text: str) -> Callable[[F], F]:
    """``--format table|json`` (a table unless asked), given to the command as ``fmt``.

    What the JSON holds is the command's own, so ``help_text`` says it.
    """
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(["table", "json"]),
        default="table",
        show_default=True,
        help=help_text,
    )
