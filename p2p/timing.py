"""Durations as a fixed-bucket histogram, kept by whoever times an operation.

Services report plain counters in `statistics()` (node status, JSON); the metrics service
(node/metrics/) turns a `Timings.snapshot()` into a Prometheus histogram. Nobody below it
imports prometheus_client. The buckets are fixed at construction, so memory is bounded
however many operations are timed.
"""

from __future__ import annotations

import bisect
from typing import Any

# 5 ms .. 2 min: a DHT query on loopback to a weight exchange of a large model over a WAN.
DEFAULT_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                        5.0, 10.0, 30.0, 60.0, 120.0)


class Timings:
    """Counts of durations per bucket (non-cumulative inside; cumulative in snapshots)."""

    def __init__(self, buckets: tuple[float, ...] = DEFAULT_BUCKETS_S) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        """`{"buckets": [[le, cumulative count], ...], "sum": s, "count": n}`, JSON-able;
        the last bucket is `"+Inf"` and equals `count`."""
        cumulative, out = 0, []
        for le, n in zip([*self.buckets, "+Inf"], self.counts, strict=True):
            cumulative += n
            out.append([le, cumulative])
        return {"buckets": out, "sum": round(self.sum, 6), "count": self.count}
