"""Which run members re-provide the run's key in the DHT (issue 30): a rendezvous sample.

Why: a DHT provider record lands on the ~20 peers closest to the key (Kademlia's k). If
every member re-provides the run key every `reprovide_s`, those 20 peers each receive
(N - 1) / reprovide_s ADD_PROVIDER a second: 333/s at 10,000 peers, on peers that are
chosen by their id alone and may be training. A joiner needs only a few providers to find
the run; after that it finds peers through them, gossip and the run document.

So only `PROVIDERS` members re-provide in each epoch: those whose rendezvous weight
`blake2b(run_id, epoch, peer)` is among the `PROVIDERS` highest of the live view (the node
itself included). The rule is the same on every node and needs no coordination: nodes
whose views agree pick the same sample, and a view that misses some peers only adds a few
providers (a node provides when fewer than `PROVIDERS` peers it sees outrank it). The
epoch (wall time // EPOCH_S) rotates the sample, so no member provides for ever and a
sample that lost its members is replaced within an epoch; a member whose view is smaller
than the sample (a fresh joiner, a small run) provides, as before. Bootstraps always
provide (node/daemon.py): they are the run's stable entry points. Pure (no I/O, no
clock): the simulator calls it too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

#: Members that re-provide the run key in an epoch: Kademlia's k, so a joiner's
#: GET_PROVIDERS at the key's closest peers returns about one full answer.
PROVIDERS = 20
#: Seconds an epoch's sample provides before the next one is drawn.
EPOCH_S = 3600.0

_DOMAIN = b"peertrain/run-providers/v1"


def epoch_of(wall_s: float, epoch_s: float = EPOCH_S) -> int:
    return int(wall_s // epoch_s)


def provider_weight(run_id: str, epoch: int, peer: str) -> int:
    """The rendezvous weight of `peer` for (run, epoch): 64 uniform bits, the same on every
    machine (not Python's salted hash())."""
    h = hashlib.blake2b(digest_size=8, person=b"run-providers")
    h.update(_DOMAIN + epoch.to_bytes(8, "big", signed=True))
    for part in (run_id, peer):
        data = part.encode()
        h.update(len(data).to_bytes(2, "big") + data)
    return int.from_bytes(h.digest(), "big")


def _key(run_id: str, epoch: int, peer: str) -> tuple[int, str]:
    return (-provider_weight(run_id, epoch, peer), peer)  # ties (never seen) broken by id


def provider_sample(run_id: str, epoch: int, peers: Iterable[str],
                    k: int = PROVIDERS) -> list[str]:
    """The `k` peers of `peers` (deduplicated) with the highest weights, highest first."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return sorted(set(peers), key=lambda p: _key(run_id, epoch, p))[:k]


def should_provide(run_id: str, epoch: int, me: str, view: Iterable[str],
                   k: int = PROVIDERS) -> bool:
    """Whether `me` re-provides the run key this epoch: fewer than `k` peers of `view`
    (`me` left out, duplicates counted once) outrank it. O(len(view)) hashes."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k == 0:
        return False
    mine = _key(run_id, epoch, me)
    above = 0
    for p in set(view):
        if p != me and _key(run_id, epoch, p) < mine:
            above += 1
            if above >= k:
                return False
    return True
