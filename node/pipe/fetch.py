"""Fetching a stage's weights for recovery over `/peertrain/pipe-weights/1.0.0`, and
resetting a connection whose streams only time out.

Recovery must not depend on which peer it asks first (issue 27: under load CheckFree fell
back to the seed's weights 4 times in 4, "cannot be rebuilt ()"):

* `WeightsFetcher.first` asks every peer that holds the part in turn (every replica of
  the stage), not only the first one; the reasons of those that failed come back with
  the None, for the log.
* `WeightsFetcher.fetch` tries one peer FETCH_TRIES times: a stream negotiation that
  outlasted py-libp2p's timeout on a loaded joiner, and a stream that ended inside the
  answer (`StreamEnded`, a truncation: churn, a reset) are tried again; a host's refusal
  (`pipe.wnone`, with its reason) and an answer that breaks the protocol are not.
* `Stalls`: a peer whose streams time out RESET_AFTER times in a row gets its connection
  closed, so that the next stream dials a fresh one. The redialer dials only peers that
  are not connected, and a connection that carried nothing any more (seen: 3 x 60 s of
  timed-out fetches) stayed open for good.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Any

import trio

from node.transport.streams import StreamEnded
from protocols import pipeline as pipe
from protocols.errors import RemoteProtocolError

log = logging.getLogger("node.pipeline")

FETCH_TRIES = 3
RESET_AFTER = 2  # streams to one peer timed out in a row: its connection is reset
RESET_S = 5.0  # closing a connection waits at most this


class WeightsRefused(RemoteProtocolError):
    """The host answered, with a reason, that it has no such weights (not retried)."""


def why(e: BaseException) -> str:
    """A failure's reason for a log line: never empty (trio.TooSlowError's text is)."""
    if isinstance(e, trio.TooSlowError):
        return "timed out"
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Stalls:
    """Per peer, how many streams in a row timed out; at `after`, its connection is
    closed (`substrate.host.disconnect`) and the count starts again."""

    def __init__(self, substrate: Any, after: int = RESET_AFTER) -> None:
        self.substrate = substrate
        self.after = after
        self.timeouts: Counter[str] = Counter()
        self.resets: Counter[str] = Counter()

    def ok(self, peer: str) -> None:
        self.timeouts.pop(peer, None)

    async def timed_out(self, peer: str) -> bool:
        """Count a timed-out stream to `peer`; True when its connection was reset."""
        self.timeouts[peer] += 1
        if self.timeouts[peer] < self.after:
            return False
        from libp2p.peer.id import ID

        del self.timeouts[peer]
        host = getattr(self.substrate, "host", None)
        if host is None:
            return False
        log.info("pipeline: %d streams to %s timed out in a row; resetting its connection",
                 self.after, peer)
        with trio.move_on_after(RESET_S), contextlib.suppress(Exception):
            await host.disconnect(ID.from_base58(peer))
        self.resets[peer] += 1
        return True


class WeightsFetcher:
    """One node's weight requests (see the module docstring)."""

    def __init__(self, substrate: Any, run_id: str, stalls: Stalls | None = None, *,
                 deadline_s: float = pipe.WEIGHTS_DEADLINE_S, tries: int = FETCH_TRIES) -> None:
        self.substrate = substrate
        self.run_id = run_id
        self.stalls = stalls or Stalls(substrate)
        self.deadline_s = deadline_s
        self.tries = tries

    async def first(self, peers: list[str], stage: int, part: str,
                    shapes: dict[str, tuple[int, ...]]
                    ) -> tuple[tuple[str, pipe.WeightsReceived] | None, list[str]]:
        """((peer, answer) from the first of `peers` that gives `part` of `stage`, or
        None; the reasons of those that failed, one "peer: reason" each)."""
        failed: list[str] = []
        for peer in peers:
            try:
                return (peer, await self.fetch(peer, stage, part, shapes)), failed
            except Exception as e:
                log.warning("pipeline: %s of stage %d from %s failed: %s", part, stage, peer,
                            why(e))
                failed.append(f"{peer[-6:]}: {why(e)}")
        return None, failed

    async def fetch(self, peer: str, stage: int, part: str,
                    shapes: dict[str, tuple[int, ...]]) -> pipe.WeightsReceived:
        """`fetch_once`, tried up to `tries` times (see the module docstring)."""
        for attempt in range(1, self.tries + 1):
            try:
                got = await self.fetch_once(peer, stage, part, shapes)
            except Exception as e:
                if isinstance(e, trio.TooSlowError):
                    await self.stalls.timed_out(peer)
                final = isinstance(e, RemoteProtocolError) and not isinstance(e, StreamEnded)
                if final or attempt == self.tries:
                    raise
                log.info("pipeline: fetching stage %d from %s failed (%s); trying again",
                         stage, peer, why(e))
                continue
            self.stalls.ok(peer)
            return got
        raise AssertionError("unreachable")

    async def fetch_once(self, peer: str, stage: int, part: str,
                         shapes: dict[str, tuple[int, ...]]) -> pipe.WeightsReceived:
        """`part` of stage `stage` from `peer`, checked against `shapes` before anything
        is allocated (protocols/pipeline.WeightsReceiver)."""
        from libp2p.peer.id import ID

        from node.transport.streams import pump

        with trio.fail_after(self.deadline_s):
            stream = await self.substrate.open_stream(ID.from_base58(peer),
                                                      pipe.WEIGHTS_PROTOCOL_ID)
            try:
                await stream.write(pipe.encode_weights_request(self.run_id, stage, part))
                rx = pipe.WeightsReceiver(self.run_id, stage, shapes)
                event = await pump(stream, rx.next_event, rx.receive_data)
            finally:
                with contextlib.suppress(Exception), trio.move_on_after(2):
                    await stream.close()
        if isinstance(event, pipe.NoWeights):
            raise WeightsRefused(f"{peer} has no weights of stage {stage}: {event.reason}")
        return event
