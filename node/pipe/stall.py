"""Whether a pipeline host's steps are completing, and if not, what it waits for.

Why: a pipeline whose steps stopped completing still said "training" on every node, and
the last stage showed a loss computed 8 minutes earlier as if it were current (issue 27).
The worker already knows when it last trained a micro-batch and whose messages it waits
for; `StallWatch` keeps those two facts (written by the trainer thread, read by status on
the trio thread: plain attribute writes) and `phase` turns them into the phase that
status, the pages and the metrics show:

* `training`: a step trained a micro-batch within STALL_DEADLINES deadlines (the worker's
  measured per-step deadline, worker.wait_s);
* `stalled: waiting for stage N since T s`: none did for longer; N is the stage whose
  messages the worker waits for (gradients from the next visit, activations from the
  previous one); T counts from the last step that trained anything;
* `stalled: waiting for stage N (no live host) since T s`: at once, whatever the
  deadlines, while a stage has no live host in the stage map: nothing can complete
  without it (on a 3-stage testnet at load 13 the deadlines kept the first stage at
  `waiting for stages` for 76 s after the kill);
* `stalled: 21 messages queued on this host since T s`: what it waits for has come, and
  its own worker has not got through it (a trainer thread starved of CPU: seen at load 16
  on 2 cores, where naming a neighbour would have sent the operator the wrong way);
* the service's own phases (choosing a stage, waiting for stages before training starts,
  recovering a stage) pass through, with how long they have lasted.

One step that loses its micro-batches to a deadline is a drop, not a stall: the rule
asks for two deadlines in a row with nothing trained.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

STALL_DEADLINES = 2  # deadlines with nothing trained before a host says it is stalled
STALLED = "stalled"  # the phase's class (metrics label), before its details


@dataclass
class StallWatch:
    """What the worker last achieved and what it waits for (trainer thread writes)."""

    last_trained: float = field(default_factory=time.monotonic)
    awaiting: int | None = None  # the stage whose messages the worker waits for
    loss_at: float | None = None  # when the last stage last computed a loss

    def trained(self, now: float | None = None) -> None:
        self.last_trained = time.monotonic() if now is None else now


@dataclass(frozen=True)
class Stall:
    stages: tuple[int, ...]  # the stage(s) waited for (none: this host is behind)
    since_s: float  # since the last step that trained a micro-batch
    no_host: bool  # those stages have no live host in this node's stage map
    queued: int = 0  # messages in this host's inbox

    def phase(self) -> str:
        if not self.stages:
            return f"{STALLED}: {self.queued} messages queued on this host since " \
                   f"{self.since_s:.0f} s"
        which = (f"stage {self.stages[0]}" if len(self.stages) == 1 else
                 "stages " + ", ".join(str(s) for s in self.stages))
        return (f"{STALLED}: waiting for {which}{' (no live host)' if self.no_host else ''}"
                f" since {self.since_s:.0f} s")

    def to_json(self) -> dict[str, Any]:
        return {"stages": list(self.stages), "since_s": round(self.since_s, 1),
                "no_host": self.no_host, "queued": self.queued}


def stall(watch: StallWatch, deadline_s: float, smap: Sequence[Sequence[str]],
          now: float | None = None, queued: int = 0) -> Stall | None:
    """The running worker's stall, or None while its steps complete (see the module).
    `queued`: messages waiting in the worker's inbox."""
    now = time.monotonic() if now is None else now
    since = now - watch.last_trained
    empty = tuple(s for s, row in enumerate(smap) if not row)
    if empty:
        return Stall(empty, since, True, queued)
    if since <= STALL_DEADLINES * deadline_s:
        return None
    if queued:
        return Stall((), since, False, queued)
    if watch.awaiting is None:
        return None  # nothing to name: the worker has not waited on anyone yet
    return Stall((watch.awaiting,), since, False, queued)


def phase_class(phase: str) -> str:
    """The phase without its details (`stalled`, `recovering`): a metric label with few
    values."""
    head = phase.split(":")[0].split(" since ")[0]
    return head.split()[0] if head.startswith(("recovering", "moving")) else head


def current(service_phase: str, phase_since: float, worker_phase: str,
            watch: StallWatch | None, deadline_s: float, smap: Sequence[Sequence[str]],
            now: float | None = None, queued: int = 0) -> tuple[str, Stall | None]:
    """The pipeline's phase now and its stall, if any: the service's own phase while no
    worker trains (`recovering stage 2 since 12 s`), the worker's while its steps complete
    or it failed, the stall's once they have stopped."""
    now = time.monotonic() if now is None else now
    if service_phase != "training" or watch is None:
        if service_phase.startswith(("recovering", "moving")):
            return f"{service_phase} since {now - phase_since:.0f} s", None
        return service_phase, None
    if worker_phase == "failed":
        return worker_phase, None
    st = stall(watch, deadline_s, smap, now, queued)
    return (st.phase(), st) if st is not None else (worker_phase, None)


def loss_age(watch: StallWatch | None, now: float | None = None) -> float | None:
    """Seconds since the last stage computed the loss it shows (None: it never did)."""
    if watch is None or watch.loss_at is None:
        return None
    return round((time.monotonic() if now is None else now) - watch.loss_at, 1)
