"""py-libp2p's gossipsub, with IDONTWANT kept to the messages it pays off for.

Gossipsub v1.2's IDONTWANT tells mesh peers not to send a message we already have, which
saves bandwidth when messages are large. py-libp2p 0.8.1 sends one for every message it
publishes or forwards, whatever its size, to every v1.2 mesh peer, each as an RPC of its
own that carries the node's signed peer record (verified by the receiver). Most of
peertrain's gossip is small messages (heartbeats: ~245 bytes, one per node and second; the
run document's deltas average ~1.2 KB and keep theirs), so each one cost a node more RPCs
out and in than the message itself: on a
4-trainer testnet, IDONTWANT emission was ~9% of a trainer's trio thread (py-spy), and
every received IDONTWANT one more peer record verified. go-libp2p sends IDONTWANT only
for messages of at least 1 KiB (its `IDontWantMessageThreshold`); so do we now. Measured
(2026-11-27): a trainer's RPCs out 38 -> 23/s and control RPCs in 23 -> 6/s; 4 idle
nodes' trio threads 3.6-4.0 -> 2.6-2.8 CPU s/min each; `node bench join`, 3 interleaved
pairs: median join 7.45 -> 7.00, 6.14 -> 5.63, 5.56 -> 5.46 s.
"""

from __future__ import annotations

from collections.abc import Iterable

from libp2p.pubsub.gossipsub import GossipSub as _GossipSub

IDONTWANT_MIN_BYTES = 1024  # go-libp2p's default IDontWantMessageThreshold


class GossipSub(_GossipSub):
    async def _emit_idontwant_for_message(self, msg_id: bytes,
                                          topic_ids: Iterable[str]) -> None:
        # publish() has put the message in the cache, under the same id, just before
        msg = self.mcache.get(msg_id)
        if msg is not None and len(msg.data) < IDONTWANT_MIN_BYTES:
            return
        await super()._emit_idontwant_for_message(msg_id, topic_ids)
