"""The guard service: the host's gate (p2p/gate.py) as a node service.

p2p/ budgets streams and connections, scores peers and bans them, but does not know what
our protocols' errors mean; this service tells it (`classify`: a RemoteProtocolError is
an invalid message, a stream that ended early is a broken one), summarizes flooded log
lines once their window ends, and shows it all in `node status` under `guard`: the
budget's limits and refusals, the lowest scores, the bans (why, until when), and how many
log lines about peers were summarized away.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from node.service import NodeContext
from node.status.logs import FLOOD, PeerFlood
from node.transport.streams import StreamEnded
from p2p.gate import Gate
from protocols.errors import RemoteProtocolError


def classify(e: BaseException) -> str | None:
    """How the gate should score a handler's exception (None: p2p's own classification)."""
    if isinstance(e, StreamEnded):
        return "broken"
    if isinstance(e, RemoteProtocolError):
        return "invalid"
    return None


class GuardService:
    name = "guard"
    protocols = ()

    def __init__(self, gate: Gate, flood: PeerFlood = FLOOD, *, flush_s: float = 10.0) -> None:
        self.gate, self.flood, self.flush_s = gate, flood, flush_s

    async def run(self, ctx: NodeContext | None = None, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:  # a flood that stopped still gets its "... N more" line
            await trio.sleep(self.flush_s)
            self.flood.flush(time.time())

    def statistics(self) -> dict[str, Any]:
        return {**self.gate.statistics(), "logs": self.flood.statistics()}
