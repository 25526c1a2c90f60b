"""The ``headgate`` command: the group, and the table of its commands.

Each command lives in the module of its name, with the code it runs:
``serve``, ``token``, ``send``, ``tail``, ``top``, ``consumers``, ``streams``
and ``cluster``; ``spark`` holds the three that need the spark extra
(``run``, ``pipeline``, ``query``), and ``demo``/``fleet_demo`` what ``run``
runs. ``options`` and ``text`` hold what several commands share.

The group imports a command's module only when that command is asked for.
``headgate serve`` must start without rich, the clients' modules or Spark
(tests/gateway/test_startup.py), and a command's module may import what
its work needs at its top. ``headgate --help`` imports them all, to show
each command's summary.
"""

from __future__ import annotations

import importlib
import logging

import click

from headgate.logformat import TEXT_FORMAT

__all__ = ["COMMANDS", "main"]

#: Every command of ``headgate``: its name, and the module and attribute
#: that define it.
COMMANDS: dict[str, tuple[str, str]] = {
    "cluster": ("headgate.cli.cluster", "cluster"),
    "consumers": ("headgate.cli.consumers", "consumers"),
    "pipeline": ("headgate.cli.spark", "pipeline_command"),
    "query": ("headgate.cli.spark", "query"),
    "run": ("headgate.cli.spark", "run"),
    "send": ("headgate.cli.send", "send"),
    "serve": ("headgate.cli.serve", "serve"),
    "streams": ("headgate.cli.streams", "streams"),
    "tail": ("headgate.cli.tail", "tail"),
    "token": ("headgate.cli.token", "token"),
    "top": ("headgate.cli.top", "top"),
}


class _Commands(click.Group):
    """A group whose commands are :data:`COMMANDS`, each imported when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        where = COMMANDS.get(cmd_name)
        if where is None:
            return None
        module, attribute = where
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command), where
        return command


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``: the version is looked up only here (see ``headgate.__version__``)."""
    if not value or ctx.resilient_parsing:
        return
    from headgate import __version__

    click.echo(f"headgate {__version__}")
    ctx.exit()


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-V",
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_show_version,
    help="Show the version and exit.",
)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """headgate: flow-controlled ingestion into Spark.

    Producers push records to a gateway over one connection each, on many
    named streams. The gateway stores each stream in a durable log; a Spark
    pipeline reads the logs and writes Parquet. A stream that Spark falls
    behind on slows only its own producers.
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=level, format=TEXT_FORMAT)
