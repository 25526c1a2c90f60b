"""The ``headgate`` command: the group, and the table of its commands.

Each command lives in the module of its name, with the code it runs:
``serve``, ``token``, ``send``, ``tail``, ``top``, ``consumers``, ``streams``
and ``cluster``; ``spark`` holds the three that need the spark extra
(``run``, ``pipeline``, ``query``), and ``demo``/``fleet_demo`` what ``run``
runs. ``options`` and ``text`` hold what several commands share.

The group imports a command's module only when that command is asked for.
``headgate serve`` must start without rich, the clients' modules or Spark
(tests/gateway/test_startup.py), and a command's module may import what
its work needs at its top. ``headgate --help`` imports none of them: each
command's one-line summary is in the table too (importing every command to
list them took 0.45 s of CPU), and a test holds the table's summary to the
command's own help (tests/test_cli.py).
"""

from __future__ import annotations

import importlib
import logging

import click

from headgate.logformat import TEXT_FORMAT

__all__ = ["COMMANDS", "SUMMARIES", "main"]

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

#: Each command's summary, as ``headgate --help`` lists it: the first
#: sentence of its help, kept here so that the list needs no import
#: (tests/test_cli.py checks each against the command itself).
SUMMARIES: dict[str, str] = {
    "cluster": "A fleet of gateways (a cluster file): its state.",
    "consumers": "A gateway's named consumers: list them (the default), reset or delete one.",
    "pipeline": "Run the Spark pipeline that CONFIG (a TOML file) describes.",
    "query": "Run SQL over the Parquet output; each stream is a table of its name.",
    "run": "The main job: gateway, demo load and Spark pipeline, on embedded defaults.",
    "send": "Send the lines of SOURCE (a file, or - for stdin) as records of STREAM.",
    "serve": "Run the gateway until SIGTERM or Ctrl-C, then flush, sync and exit.",
    "streams": (
        "List and describe a gateway's streams; delete one from a stopped gateway's directory."
    ),
    "tail": "Print records of STREAM as the gateway appends them.",
    "token": "Make a new random token and print the tokens-file entry for it.",
    "top": "Watch a running gateway: streams and connections, live.",
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

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The list of commands, from :data:`SUMMARIES`: no command is imported."""
        names = self.list_commands(ctx)
        if not names:
            return
        # The width click gives a summary (click.Group.format_commands).
        limit = formatter.width - 6 - max(len(name) for name in names)
        # A bare command with the summary as its help shortens it as the real
        # one would.
        rows = [
            (name, click.Command(name, help=SUMMARIES[name]).get_short_help_str(limit))
            for name in names
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


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
