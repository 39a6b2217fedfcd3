"""Who to blame: the peer whose stream the current task is handling.

The gate (p2p/gate.py) scores what a handler raises. Some library handlers (KadDHT's,
py-libp2p's AutoNAT and identify/push) catch their errors and only log them; code that
runs inside them (a screened read, p2p/dht.py and p2p/screens.py) calls `blame`, and the
gate that guards the stream scores its peer. A context variable carries the pair, so it
follows the handler's task and nothing else: outside a guarded handler (our own
requests), `blame` does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator

log = logging.getLogger("p2p.gate")

Penalize = Callable[[str, str], object]  # (peer, kind)

_on_stream: contextvars.ContextVar[tuple[Penalize, str] | None] = contextvars.ContextVar(
    "peer_on_stream", default=None)


@contextlib.contextmanager
def serving(penalize: Penalize, peer: str) -> Iterator[None]:
    """While a guarded handler serves `peer`'s stream: `blame` penalizes `peer`."""
    token = _on_stream.set((penalize, peer))
    try:
        yield
    finally:
        _on_stream.reset(token)


def blame(kind: str, why: str) -> bool:
    """Score the peer whose stream this task is handling for `kind`; False (nothing done)
    outside a guarded handler."""
    current = _on_stream.get()
    if current is None:
        return False
    penalize, peer = current
    penalize(peer, kind)
    log.info("%s from peer %s: %s", kind, peer, why, extra={"peer": peer, "reason": kind})
    return True
