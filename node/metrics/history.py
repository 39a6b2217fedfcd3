"""A bounded history of training progress: the points of the status page's loss curves.

A run may last weeks; the page should show all of it in a fixed amount of memory. The
history keeps at most `capacity` points; when full, it drops every other point and doubles
the spacing it keeps new points at, so it always spans the whole run at a resolution that
halves as the run doubles (a 2,000-point curve is as much as a page draws anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Point:
    t: float  # unix seconds
    step: int
    loss: float | None
    val_loss: float | None


class History:
    def __init__(self, capacity: int = 2000, min_interval_s: float = 2.0) -> None:
        if capacity < 2:
            raise ValueError("a history needs room for at least 2 points")
        self.capacity = capacity
        self.interval_s = min_interval_s  # grows as the history thins itself
        self.points: list[Point] = []

    def add(self, t: float, step: int, loss: float | None, val_loss: float | None) -> bool:
        """Record progress at time t; returns whether a point was kept. Kept: the first
        point, and any whose step moved on once `interval_s` has passed, or whose
        validation loss is new (evaluations are rarer than steps: none is dropped)."""
        last = self.points[-1] if self.points else None
        if last is not None:
            new_val = val_loss is not None and val_loss != last.val_loss
            if step == last.step and not new_val:
                return False
            if t - last.t < self.interval_s and not new_val:
                return False
        self.points.append(Point(t, step, loss, val_loss))
        if len(self.points) > self.capacity:
            self.points = self.points[::2] if len(self.points) % 2 else \
                [*self.points[:-1:2], self.points[-1]]  # keep the newest
            self.interval_s *= 2
        return True

    def to_json(self) -> list[list[Any]]:
        """[[t, step, loss, val_loss], ...]: compact for /api/status."""
        return [[round(p.t, 1), p.step, p.loss, p.val_loss] for p in self.points]
