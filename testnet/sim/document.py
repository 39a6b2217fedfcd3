"""The run document's size under churn, compacted by the node's own rule.

Entries are `protocols.rundoc.Entry` with their keys and stamps (empty values, unsigned:
compaction reads neither): each peer that
joins writes `entries_per_peer` keys under `peer/<id>/`; a live peer re-announces (its
`last_seen` entry gets a fresh stamp at every compaction check, as its announces and
`RunDocument.refresh` keep its newest stamp within one announce interval); a departed
peer's keys keep their last stamps. What is dropped is decided by
`protocols.rundoc.compactable`, the function `RunDocument.gc` calls, on these entries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from protocols.rundoc import Entry, Stamp, compactable


class DocModel:
    """Keys and stamps of a replica's run document; `compact` applies the node's rule."""

    def __init__(self, entries_per_peer: int) -> None:
        self.per_peer = max(1, entries_per_peer)
        self.entries: dict[str, Entry] = {}
        self._last_seen: dict[str, str] = {}  # peer -> the key its announces re-stamp
        self.peak = 0
        self.compacted = 0

    def __len__(self) -> int:
        return len(self.entries)

    def join(self, peer: str, now_s: float) -> None:
        stamp = Stamp(int(now_s * 1000), 0, peer)
        for j in range(self.per_peer):
            key = f"peer/{peer}/k{j}"
            self.entries[key] = Entry(key, b"", stamp, False, b"")
        self._last_seen[peer] = f"peer/{peer}/k0"
        self.peak = max(self.peak, len(self.entries))

    def leave(self, peer: str, now_s: float) -> None:
        """`peer` stops announcing: its last stamp is now."""
        self.touch([peer], now_s)
        self._last_seen.pop(peer, None)

    def touch(self, peers: list[str], now_s: float) -> None:
        """Live `peers` announced up to now."""
        for p in peers:
            key = self._last_seen.get(p)
            if key is not None and key in self.entries:
                self.entries[key] = replace(self.entries[key],
                                            hlc=Stamp(int(now_s * 1000), 0, p))

    def compact(self, now_s: float, horizon_s: float) -> int:
        drop = compactable(self.entries.values(), int(now_s * 1000), int(horizon_s * 1000))
        for key in drop:
            del self.entries[key]
        self.compacted += len(drop)
        return len(drop)


@dataclass
class DocChurn:
    n: int
    hours: float
    horizon_s: float  # 0: never compacted
    joins: int
    entries: int  # at the end
    peak: int  # the most at any check
    cap: int  # RunDocument's max_entries: past it new keys are refused


def document_under_churn(n: int, per_hour: float, hours: float, entries_per_peer: int,
                         horizon_s: float, seed: int, checks_per_horizon: int = 8) -> DocChurn:
    """The document of a swarm of n live peers over `hours` of churn (Poisson leaves at
    `per_hour` per peer, joins keeping n level), compacted every horizon / 8 by the node's
    rule when `horizon_s` > 0 (the swarm's training rounds do not matter here, so this runs
    hours of membership in seconds)."""
    import heapq
    import inspect

    import numpy as np

    from protocols.rundoc import RunDocument

    rng = np.random.default_rng([seed, n, 11])
    doc = DocModel(entries_per_peer)
    rate = per_hour / 3600
    live: set[str] = set()
    heap: list[tuple[float, int, str]] = []
    count = 0

    def join(now: float) -> None:
        nonlocal count
        pid = f"{count:07d}"
        count += 1
        live.add(pid)
        doc.join(pid, now)
        if rate > 0:
            heapq.heappush(heap, (now + float(rng.exponential(1 / rate)), 0, pid))

    for _ in range(n):
        join(0.0)
    end = hours * 3600
    if rate > 0:
        heapq.heappush(heap, (float(rng.exponential(1 / (n * rate))), 1, ""))
    step = horizon_s / checks_per_horizon if horizon_s > 0 else end / 100
    t_check = step
    joins = 0
    while True:
        at = heap[0][0] if heap else end
        while t_check <= min(at, end):
            if horizon_s > 0:
                doc.touch(sorted(live), t_check)
                doc.compact(t_check, horizon_s)
            doc.peak = max(doc.peak, len(doc))
            t_check += step
        if not heap or at > end:
            break
        now, kind, pid = heapq.heappop(heap)
        if kind == 1:
            join(now)
            joins += 1
            heapq.heappush(heap, (now + float(rng.exponential(1 / (n * rate))), 1, ""))
        elif pid in live:
            live.discard(pid)
            doc.leave(pid, now)
    cap = inspect.signature(RunDocument).parameters["max_entries"].default
    return DocChurn(n, hours, horizon_s, joins, len(doc), doc.peak, int(cap))
