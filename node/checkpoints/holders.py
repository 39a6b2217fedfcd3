"""Checkpoint provision over many holders (issue 30): which holders a joiner asks, and how
many askers a holder serves at once. Pure (no I/O, no clock): the simulator calls them too.

Every node that pulled and vetted a checkpoint announces itself as one more holder of it
(`peer/<id>/ckpt/<cid>`, with the checkpoint's `writer`). When 10% of a swarm of 10,000
joins at once, 1,000 joiners asking the writer alone (or every holder each) would put the
whole load on one peer (or on all of them). Instead each joiner ranks the holders by
rendezvous hashing (highest random weight: `blake2b(cid, asker, holder)`) and asks its
first `k`: a fixed, uniformly random choice per (joiner, checkpoint) that needs no
coordination, spreads n joiners over h holders at about n * k / h each, and changes for
only ~k / h of the joiners when a holder comes or goes. A holder serves at most
`max_uploads` askers at once and refuses the next ones as busy, so the asker's pull moves
its chunks to its other holders (node/checkpoints/exchange.py).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

#: Holders a joiner asks at once (the pull fetches chunks from all of them in parallel).
SOURCES = 4
#: Askers a holder serves at once; the next is refused as busy (exchange.py).
MAX_UPLOADS = 4

_DOMAIN = b"peertrain/ckpt-holders/v1"


def holder_weight(cid: str, asker: str, holder: str) -> int:
    """The rendezvous weight of `holder` for `asker`'s pull of `cid`: 64 uniform bits,
    the same on every machine (not Python's salted hash())."""
    h = hashlib.blake2b(digest_size=8, person=b"ckpt-holders")
    h.update(_DOMAIN)
    for part in (cid, asker, holder):
        data = part.encode()
        h.update(len(data).to_bytes(2, "big") + data)
    return int.from_bytes(h.digest(), "big")


def rank_holders(cid: str, asker: str, holders: Iterable[str]) -> list[str]:
    """`holders` (deduplicated, `asker` left out), highest rendezvous weight first."""
    unique = {h for h in holders if h != asker}
    return sorted(unique, key=lambda h: (-holder_weight(cid, asker, h), h))


def choose_holders(cid: str, asker: str, holders: Iterable[str], k: int = SOURCES,
                   exclude: Iterable[str] = ()) -> list[str]:
    """The `k` holders `asker` asks for `cid` (those in `exclude`, already asked or known
    busy, left out): the first of `rank_holders`."""
    if k < 0:
        raise ValueError("k must be >= 0")
    skip = set(exclude)
    return [h for h in rank_holders(cid, asker, holders) if h not in skip][:k]


class UploadSlots:
    """At most `cap` askers served at once; one asker may hold several sessions (a
    stream and a lane) and counts once. `acquire` says whether a session may start."""

    def __init__(self, cap: int = MAX_UPLOADS) -> None:
        if cap < 1:
            raise ValueError("cap must be >= 1")
        self.cap = cap
        self._sessions: Counter[str] = Counter()
        self.refused = 0  # sessions refused as busy

    def acquire(self, asker: str) -> bool:
        if asker not in self._sessions and len(self._sessions) >= self.cap:
            self.refused += 1
            return False
        self._sessions[asker] += 1
        return True

    def release(self, asker: str) -> None:
        self._sessions[asker] -= 1
        if self._sessions[asker] <= 0:
            del self._sessions[asker]

    @property
    def askers(self) -> int:
        """Askers being served now."""
        return len(self._sessions)
