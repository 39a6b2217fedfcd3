"""NoLoCo grouping: who averages with whom in outer round `round`.

Every peer must compute the same groups without talking to anyone, from what they already
agree on: the round number and the set of live peer ids (spec section 1c, 1g). So the
grouping is a pure function of (round, sorted peer ids):

1. Sort the ids (as strings), so the order peers were listed in does not matter.
2. Seed a counter-mode SHA-256 generator with (round, the sorted ids). Not Python's
   `hash()` (salted per process), not `random` or numpy (their streams may change between
   versions): SHA-256 is the same on every machine, forever.
3. Fisher-Yates shuffle the N indices with it: a permutation `perm`.
4. Deal `perm` into g = max(1, N // group_size) groups, strided as in the reference
   (gensyn-ai/noloco `sparse_optimizer_c.py`): group k = {perm[k], perm[k+g], perm[k+2g], ...}.

When N is a multiple of `group_size` this is exactly the reference's layout: g groups of
`group_size`. Otherwise the reference refuses; here the N % group_size leftover positions
are dealt round-robin onto the first groups, so some groups get one extra member and no
group is ever smaller than `group_size` (a peer left alone would learn nothing from
anyone that round). With group_size 2 and N odd, that means one group of three. With
N < group_size everyone is in one group; N = 1 gives a group of one (a local step).

Different membership views give different groupings: peers that disagree on the live set
may not find each other, and fall back to the local step (spec 1c, "peer missing").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_DOMAIN = b"peertrain/noloco-groups/v1"


class _HashStream:
    """Uniform integers from SHA-256(seed || counter): reproducible on every platform."""

    def __init__(self, seed: bytes):
        self._seed = seed
        self._counter = 0

    def _word(self) -> int:
        block = hashlib.sha256(self._seed + self._counter.to_bytes(8, "big")).digest()
        self._counter += 1
        return int.from_bytes(block[:8], "big")

    def below(self, n: int) -> int:
        """Uniform in [0, n), by rejection (no modulo bias)."""
        limit = (1 << 64) - (1 << 64) % n
        while True:
            word = self._word()
            if word < limit:
                return word % n


def _check(round: int, peers: Sequence[str], group_size: int) -> list[str]:
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError(f"round must be a non-negative int, got {round!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    ids = sorted(peers)
    if len(set(ids)) != len(ids):
        raise ValueError("peer ids must be unique")
    return ids


def permutation(round: int, peers: Sequence[str], salt: int = 0) -> list[int]:
    """The shared permutation of the sorted peer ids for this round (indices into them);
    `salt` > 0 draws further independent permutations of the same round."""
    ids = _check(round, peers, 1)
    seed = hashlib.sha256(
        _DOMAIN
        + (b"salt" + salt.to_bytes(4, "big") if salt else b"")
        + round.to_bytes(8, "big")
        + b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in ids)
    ).digest()
    stream = _HashStream(seed)
    perm = list(range(len(ids)))
    for i in range(len(perm) - 1, 0, -1):
        j = stream.below(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def noloco_groups(round: int, peers: Sequence[str], group_size: int = 2) -> list[list[str]]:
    """Partition `peers` into this round's averaging groups (see the module docstring).

    Every peer is in exactly one group; the result depends only on (round, set of peers).
    """
    ids = _check(round, peers, group_size)
    if not ids:
        return []
    perm = permutation(round, ids)
    n_groups = max(1, len(ids) // group_size)
    return [[ids[perm[j]] for j in range(k, len(ids), n_groups)] for k in range(n_groups)]


def group_of(me: str, round: int, peers: Sequence[str], group_size: int = 2) -> list[str]:
    """The group `me` belongs to this round, `me` included."""
    for group in noloco_groups(round, peers, group_size):
        if me in group:
            return group
    raise ValueError(f"{me!r} is not among the peers")


def partner_of(me: str, round: int, peers: Sequence[str], group_size: int = 2) -> list[str]:
    """The other members of `me`'s group: usually one partner, two in an odd-sized view's
    group of three, none when `me` is alone (then the outer step is a local step)."""
    return [p for p in group_of(me, round, peers, group_size) if p != me]


def neighbours_of(me: str, round: int, peers: Sequence[str], k: int) -> list[str]:
    """Gossip learning's k neighbours of `me` this round, a symmetric relation (if b is a's
    neighbour, a is b's), from (round, set of peers) alone like the groups above.

    Each of k // 2 independent random rings gives its two ring neighbours; an odd k adds
    the partner of a random pairing (NoLoCo's groups of 2). Unlike one group of k + 1,
    every peer talks to about k others however large the swarm: with 7 peers and k = 3,
    groups would put all 7 in one group of 6 exchanges each. Overlapping rings can give a
    peer fewer than k distinct neighbours; n <= k + 1 gives everyone else.
    """
    ids = _check(round, peers, 1)
    if me not in ids:
        raise ValueError(f"{me!r} is not among the peers")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(ids) <= k + 1:
        return [p for p in ids if p != me]
    out: set[str] = set()
    for ring in range(1, k // 2 + 1):
        order = [ids[i] for i in permutation(round, ids, salt=ring)]
        at = order.index(me)
        out.update((order[at - 1], order[(at + 1) % len(order)]))
    if k % 2:
        out.update(partner_of(me, round, ids, 2))
    out.discard(me)
    return sorted(out)
