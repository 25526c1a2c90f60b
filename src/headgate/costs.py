"""What a Batch costs in guarantees, shared by producers and the gateway.

Guarantees on a data channel are log bytes, so a producer must charge a batch
exactly what the gateway's append will take from the log; both sides import
this one function so the two sums can never drift apart.
"""

from __future__ import annotations

from headgate.log import frame_cost
from headgate.protocol.messages import BATCH_HEADER_SIZE

__all__ = ["batch_cost"]


def batch_cost(payload_length: int) -> int:
    """Guarantees a Batch message with ``payload_length`` bytes of payload uses.

    The gateway stores the records block (the payload minus its sequence
    header, which becomes the frame header's first sequence) as one log frame.
    """
    return frame_cost(max(0, payload_length - BATCH_HEADER_SIZE))
