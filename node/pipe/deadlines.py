"""How long a pipeline stage waits for its messages (worker.py, drive.py, serve_loop.py).

A stage never waits without a deadline. The deadline is measured: 4 x the EWMA of the
step's round trip, at least MIN_WAIT_S (FIRST_WAIT_S before the first step completes:
every stage warms up then). The loops read their inbox POLL_S at a time, so that a stop
or a deadline is noticed within that.
"""

from __future__ import annotations

MIN_WAIT_S = 5.0
FIRST_WAIT_S = 60.0
POLL_S = 0.5


def step_deadline(step_s: float, first_wait_s: float) -> float:
    """The wait for a step's messages, from the EWMA of a step's wall time (0: none
    measured yet, `first_wait_s`)."""
    if step_s == 0:
        return first_wait_s
    return max(MIN_WAIT_S, 4 * step_s)
