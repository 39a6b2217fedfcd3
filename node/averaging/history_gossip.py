"""`/peertrain/sybilwall/1.0.0`: SybilWall's probabilistic gossip of update histories.

After each round a peer sends every neighbour it exchanged with one entry of its history
table (specs/algorithms.md §3c step 3: nearby peers preferred), so sybils scattered over the
swarm still meet in one similarity matrix. One signed entry per stream:

* an entry for a peer we observed directly (distance 1) is signed by us, its observer;
* a gossiped entry is forwarded with its observer's signature unchanged, so nobody can
  invent a history for a peer in someone else's name (the distance is unsigned: it grows
  by one per hop, and an absurd one is refused).

Everything received is bounded and checked before it touches the table: the message size
(one vector of our model's size plus a small header) before decoding, the signature, the
run, the vector's length and values (protocols/history.py), then the table's own rules
(node/ml/aggregate/history.py: self entries, distance, per-sender flood, table size). Each
refusal is logged with its reason and counted in `node status`.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from node.ml.aggregate.history import HistoryEntry
from node.service import NodeContext
from node.transport.streams import close_quietly
from protocols import history as hp
from protocols.errors import ProtocolError

log = logging.getLogger("node.averaging.history")

PROTOCOL_ID = hp.PROTOCOL_ID


class HistoryGossip:
    """Sends and receives history entries for one run. The table lives in the aggregator of
    the trainer's GossipLearning (node/ml/optim/gossip.py), built in the trainer thread and
    published as `ctx.run.outer` (None before); its `lock` guards the table. The averager
    calls `after_round` with each round's neighbours."""

    name = "history_gossip"
    protocols = (PROTOCOL_ID,)

    def __init__(self, *, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.sent = 0
        self.accepted = 0
        self.refused: Counter[str] = Counter()
        self._ctx: NodeContext | None = None

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._ctx = ctx
        self.substrate, self.signer = ctx.substrate, ctx.signer
        self.run_id, self.me = ctx.the_run().run_id, ctx.peer_id
        ctx.substrate.set_handler(PROTOCOL_ID, self._handle)
        task_status.started()
        await trio.sleep_forever()

    @property
    def learning(self) -> Any:
        return self._ctx.run.outer if self._ctx is not None and self._ctx.run else None

    @property
    def max_bytes(self) -> int:
        return hp.LIMITS.for_model(self.learning.numel).max_envelope_bytes

    def statistics(self) -> dict[str, Any]:
        return {"sent": self.sent, "accepted": self.accepted, "refused": dict(self.refused),
                "known": len(self._table().entries) if self._table() is not None else 0}

    def _table(self) -> Any:
        learning = self.learning
        return None if learning is None else getattr(learning.aggregator, "history", None)

    # -- sending --------------------------------------------------------------------------

    async def after_round(self, neighbours: list[str]) -> None:
        """Send each neighbour one sampled entry; never raises (gossip is best effort)."""
        table = self._table()
        if table is None:
            return
        for q in neighbours:
            with self.learning.lock:
                picked = table.sample_for(q, self.rng)
                message = self._message(picked) if picked is not None else None
            if message is None:
                continue
            try:
                with trio.fail_after(5):
                    stream = await self.substrate.open_stream(ID.from_base58(q), PROTOCOL_ID)
                    try:
                        await stream.write(message)
                    finally:
                        await stream.close()
                self.sent += 1
            except Exception as e:  # a gone or slow neighbour: the next round tries again
                log.debug("history gossip to %s failed: %r", q, e)

    def _message(self, entry: HistoryEntry) -> bytes:
        if entry.distance == 1:  # we observed it: we vouch for it
            return hp.encode_history(self.signer, self.run_id, entry.peer, entry.round,
                                     entry.distance, entry.vector)
        assert isinstance(entry.proof, hp.SignedHistory)  # the table keeps it for gossip
        return hp.forward_history(entry.proof, entry.distance)

    # -- receiving ------------------------------------------------------------------------

    async def _handle(self, stream: INetStream) -> None:
        sender = stream.muxed_conn.peer_id.to_base58()
        try:
            if self._table() is None:
                raise hp.HistoryError("this node does not run SybilWall (yet)")
            with trio.fail_after(hp.LIMITS.deadline_s or 10.0):
                data = await _read_all(stream, self.max_bytes)
            self._receive(sender, data)
        except (ProtocolError, trio.TooSlowError) as e:
            self._refuse(sender, str(e))
        finally:
            await close_quietly(stream)  # what we did not read is dropped, not kept a minute

    def _receive(self, sender: str, data: bytes) -> None:
        table = self._table()
        if table is None:
            raise hp.HistoryError("this node does not run SybilWall")
        msg = hp.decode_history(data, run_id=self.run_id, expected_len=self.learning.numel,
                                max_bytes=self.max_bytes)
        if (msg.distance == 1) != (msg.observer == sender):
            raise hp.HistoryError("distance 1 means observed by the sender, and only that")
        entry = HistoryEntry(msg.subject, msg.round, msg.distance, msg.vector, proof=msg)
        with self.learning.lock:
            reason = table.offer(sender, entry)
        if reason is not None:
            self._refuse(sender, reason)
        else:
            self.accepted += 1

    def _refuse(self, sender: str, reason: str) -> None:
        self.refused[reason.split(":")[0][:60]] += 1
        log.info("refused a history entry from %s: %s", sender, reason,
                 extra={"peer": sender, "reason": "history entry"})


async def _read_all(stream: INetStream, limit: int) -> bytes:
    """The whole stream, refusing it as soon as it passes `limit` bytes."""
    buf = bytearray()
    while True:
        try:
            data = await stream.read(64 * 1024)
        except StreamEOF:
            data = b""
        if not data:
            return bytes(buf)
        buf += data
        if len(buf) > limit:
            raise hp.HistoryError(f"history message over {limit} bytes")
