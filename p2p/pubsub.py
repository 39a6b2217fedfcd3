"""Paced gossip publishing.

py-libp2p's gossipsub drops silently when a peer's 32-slot outbound queue is full: 200
messages published back to back delivered 16 of them, with a 5 ms gap all 200
(notes/libp2p.md §5). `PacedPublisher` is the one place messages leave this node: a small
bounded queue drained with a minimum gap, so a burst is delivered late instead of lost,
and an overflow is counted instead of silent. Gossip stays lossy; protocols on top make
their messages idempotent and re-announce state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from p2p.host import Substrate

log = logging.getLogger(__name__)


@dataclass
class PublisherStats:
    published: int = 0
    dropped: int = 0
    failed: int = 0


class PacedPublisher:
    def __init__(self, substrate: Substrate, *, min_gap_s: float = 0.005, queue: int = 64) -> None:
        self.substrate = substrate
        self.min_gap_s = min_gap_s
        self.stats = PublisherStats()
        self._send, self._receive = trio.open_memory_channel[tuple[str, bytes]](queue)

    def publish_nowait(self, topic: str, data: bytes) -> bool:
        """Queue a message; False (and counted) if the queue is full."""
        try:
            self._send.send_nowait((topic, data))
            return True
        except trio.WouldBlock:
            self.stats.dropped += 1
            return False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for topic, data in self._receive:
            await self.substrate.ready.wait()
            pubsub = self.substrate.pubsub
            assert pubsub is not None
            try:
                await pubsub.publish(topic, data)
                self.stats.published += 1
            except Exception as e:  # a publish failure is a lost message, never a dead node
                self.stats.failed += 1
                log.info("publish on %s failed: %r", topic, e)
            await trio.sleep(self.min_gap_s)
