"""A gateway's place in a fleet: which partitions it serves, and what Metadata answers.

The rules live in :mod:`headgate.cluster`; this adapter turns them into the
protocol's errors and answers. A gateway without a cluster file has no
:class:`FleetMembership`: it serves every name, and answers Metadata with
an empty cluster.
"""

from __future__ import annotations

from pathlib import Path

from headgate.cluster import Cluster, ClusterError, load_cluster
from headgate.config import parse_address
from headgate.protocol import messages as m
from headgate.protocol.errors import ProtocolError

__all__ = ["FleetMembership", "metadata_without_cluster"]


class FleetMembership:
    """This gateway is ``name`` of ``cluster``: it serves the partitions assigned to it."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster = cluster
        self.name = name

    @classmethod
    def load(cls, path: Path, name: str) -> FleetMembership:
        """Read the cluster file; ClusterError (one line) if it is wrong or does not name us."""
        cluster = load_cluster(path)
        if name not in cluster.gateways:
            raise ClusterError(
                f"{path}: no gateway named {name!r} (cluster_name); it names "
                f"{', '.join(cluster.gateways)}"
            )
        return cls(cluster, name)

    def listen_mismatch(self, listen: tuple[str, int]) -> str | None:
        """A warning when this gateway listens on another port than clients are told
        (a copy of the file that does not match, or the wrong ``cluster_name``)."""
        entry = self.cluster.gateways[self.name]
        _, port = parse_address(entry.address)
        if listen[1] in (0, port):
            return None
        return (
            f"the cluster file says gateway {self.name} is at {entry.address}, but it "
            f"listens on port {listen[1]}: clients will not reach it there"
        )

    def misplaced(self, on_disk: list[str]) -> str | None:
        """A warning naming the logs on disk this gateway may not serve (a partition the
        cluster file now assigns elsewhere): their records stay on disk, unread."""
        names = [name for name in on_disk if self.refusal(name) is not None]
        if not names:
            return None
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return (
            f"{len(names)} stream log(s) on disk are not this gateway's in the cluster "
            f"file ({shown}): they are kept but not served; move each to the gateway "
            "that holds it"
        )

    def refusal(self, stream: str) -> ProtocolError | None:
        """Why this gateway must not write or serve the log ``stream``, or None."""
        found = self.cluster.refusal(stream, self.name)
        return None if found is None else ProtocolError(found[1], code=found[0])

    def metadata(self, request_id: int) -> m.ClusterMetadata:
        """The answer to a Metadata request: the assignment this gateway runs under."""
        return self.cluster.metadata(request_id, self.name)


def metadata_without_cluster(request_id: int, server_name: str) -> m.ClusterMetadata:
    """A gateway on its own answers Metadata with no gateways and no streams."""
    return m.ClusterMetadata(request_id=request_id, gateway=server_name, gateways=(), streams=())
