"""Yamux whose frame writes are never cut half way (issue 26, item 6).

py-libp2p 0.8.1's `Yamux._write_frame` takes the connection's write lock and hands the
frame to the secure session, which encrypts it with the next Noise nonce and then sends
it. A caller cancelled inside that send (a `move_on_after` around a stream write, a
nursery cancelling a task that was writing) leaves the nonce spent and the frame unsent,
or half sent: the other end decrypts every later message with the wrong nonce, fails, and
closes the whole connection with all its streams. Any writer on a busy connection could
do this; the relay does it routinely, cancelling a circuit's other direction when one
ends, and a private node lost its relay link (and its reservation) when several of its
duplicate relayed connections ended together, about 1 in 8 namespace runs of
tests/swarm/test_relay_duplicate_nat.py (docs/nat.md). We found no upstream issue for it.

`install()` replaces `Yamux._write_frame` (py-libp2p's muxer negotiation builds `Yamux`
itself, whatever class the host's muxer options name). The new one waits for the lock as
before (cancellable), then sends the frame shielded:
a frame is written whole or the connection is given up. A send that stays blocked past
`FRAME_WRITE_TIMEOUT_S` (the peer stopped reading) closes the connection rather than
hang, since a half-written frame has broken its framing anyway.
"""

from __future__ import annotations

import contextlib

import trio
from libp2p.stream_muxer.exceptions import MuxedConnUnavailable
from libp2p.stream_muxer.yamux.yamux import Yamux

FRAME_WRITE_TIMEOUT_S = 30.0


_original = Yamux._write_frame


async def _write_frame_whole(self: Yamux, data: bytes) -> None:
    """py-libp2p's `_write_frame`, the send shielded (module docstring)."""
    async with self._write_lock:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(FRAME_WRITE_TIMEOUT_S) as late:
                await self.secured_conn.write(data)
            if late.cancelled_caught:
                with trio.move_on_after(1), contextlib.suppress(Exception):
                    await self.secured_conn.close()
                raise MuxedConnUnavailable(
                    f"a frame write to {self.peer_id} stayed blocked "
                    f"{FRAME_WRITE_TIMEOUT_S:g} s: connection closed")
    await trio.lowlevel.checkpoint()  # the cancellation the shield held back, if any


def install() -> None:
    """Make every Yamux connection of this process write its frames whole (idempotent)."""
    Yamux._write_frame = _write_frame_whole  # type: ignore[method-assign]
