"""What a query's checkpoint records, read without Spark: its definition and its committed end.

Spark's checkpoint fixes which offsets each micro-batch covers, so a
replayed batch writes the same rows under the same names
(:func:`~headgate.spark.transform.commit_batch`). It is valid only for the
query it was made for: :func:`check_definitions` keeps a record of that
definition beside it and refuses a checkpoint made for another one.
:func:`committed_positions` reads where the last committed batch ended, so
that a restarted pipeline releases it before Spark starts.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from headgate.config import ConfigError
from headgate.log.address import AddressError
from headgate.spark.pipeline_config import PipelineConfig, meta_columns
from headgate.spark.planning import offset_address

__all__ = ["DEFINITION_FILE", "check_definitions", "committed_positions", "query_definition"]


#: The file in each stream's checkpoint that records what the query was made for.
DEFINITION_FILE = "headgate-definition.json"


def query_definition(config: PipelineConfig, stream: str) -> dict[str, Any]:
    """What a checkpoint is only valid for: how records are read, shaped and where they go.

    Read limits and the trigger interval are not part of it: Spark resumes a
    checkpoint under new ones.
    """
    spec = config.stream(stream)
    return {
        "stream": spec.name,
        # The columns the pipeline adds: a checkpoint from before ``index``
        # was one of them has no such key, and is refused like any change.
        "columns": list(meta_columns(config)),
        "format": spec.format,
        "schema": spec.schema,
        "options": [list(pair) for pair in spec.options],
        "transform": spec.transform,
        "partition_by": list(spec.partition_by),
        "output": str(config.output(stream).resolve()),
        "dead_letters": str(config.dead_letters(stream).resolve()),
    }


def check_definitions(config: PipelineConfig, *, write_new: bool = True) -> None:
    """Refuse a checkpoint made for another definition of its query; record new ones.

    Resuming a checkpoint under a new format, schema or transform would write
    rows of two shapes into one dataset (or into another one), which a reader
    then miscounts without a word.

    ``write_new``: False only checks, for a caller that has not yet had the
    definitions checked by Spark's analyser (a bad schema must not be recorded).

    Raises:
        ConfigError: a stream's checkpoint belongs to another definition; the
            message names what changed and how to start over.
    """
    for spec in config.streams:
        checkpoint = config.checkpoint(spec.name)
        record = checkpoint / DEFINITION_FILE
        wanted = query_definition(config, spec.name)
        if record.exists():
            try:
                stored = json.loads(record.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"{config.origin}: stream {spec.name!r}: cannot read {record}: {exc}"
                ) from None
            if not isinstance(stored, dict):
                stored = {}
            changed = [key for key in wanted if stored.get(key) != wanted[key]]
            if changed:
                why = f"{', '.join(changed)} changed"
                if "columns" in changed:  # a checkpoint of an older headgate
                    why += f"; rows now carry {', '.join(meta_columns(config))}"
                raise ConfigError(
                    f"{config.origin}: stream {spec.name!r}: its checkpoint {checkpoint} "
                    f"was made for another definition ({why}). "
                    f"To start over, delete {checkpoint} and {config.output(spec.name)}, "
                    "or give the stream a new checkpoint and output directory"
                )
            continue
        if (checkpoint / "offsets").is_dir() and any((checkpoint / "offsets").iterdir()):
            # Spark has run this query, under a headgate that recorded no
            # definitions: its rows had no ``index`` column.
            raise ConfigError(
                f"{config.origin}: stream {spec.name!r}: its checkpoint {checkpoint} was made "
                f"by an older headgate, whose rows lacked columns they now carry "
                f"({', '.join(meta_columns(config))}). To start over, delete {checkpoint} and "
                f"{config.output(spec.name)}, or give the stream a new checkpoint and output "
                "directory"
            )
        if not write_new:
            continue
        # A new checkpoint: record what it is for.
        checkpoint.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(".tmp")
        partial.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
        os.replace(partial, record)


def committed_positions(checkpoint: Path) -> dict[str, int]:
    """The end positions of the last batch a query's checkpoint records as committed.

    Spark writes ``offsets/N`` (the planned end of batch N: a version line, a
    metadata line, then one line per source) before it runs the batch, and
    ``commits/N`` after. The release that followed ``commits/N`` may not have
    reached the gateway before a kill; sending it again at start costs
    nothing (the gateway ignores a release that does not move forward) and
    gives producers their credit back before Spark's first batch, which can
    take minutes over a full log. Anything unreadable counts as nothing
    committed: the listener releases after the first batch, as before.
    """
    commits = checkpoint / "commits"
    try:
        done = sorted((int(f.name) for f in commits.iterdir() if f.name.isdigit()), reverse=True)
    except OSError:
        return {}
    for batch_id in done:
        try:
            lines = (checkpoint / "offsets" / str(batch_id)).read_text().splitlines()
        except OSError:
            continue
        positions: dict[str, int] = {}
        for line in lines[2:]:
            try:
                offset = json.loads(line)
            except ValueError:
                continue
            if isinstance(offset, dict):
                for stream, value in offset.items():
                    with contextlib.suppress(AddressError):
                        positions[str(stream)] = offset_address(value).position
        return positions
    return {}
