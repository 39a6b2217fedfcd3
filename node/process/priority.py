"""Training is background work: the CPU priority a node's trainer runs at.

Two levers, because Linux's autogroup scheduling (on by default) gives every *session* an
equal share of the CPU and applies a thread's nice only among the threads of its session:

- the trainer thread's nice (`lower_thread_priority`) makes it yield to its own node's
  trio thread, so a node short of CPU answers its peers first;
- the session's autogroup nice (`lower_session_priority`) makes a training node yield to
  the machine's other sessions: a joiner that has not trained yet (its imports, download
  and model build are the join's critical path), and whatever else the owner runs. With
  it, 4 busy sessions at nice 10 on 2 cores left a fifth CPU-bound process 0.45 s for what
  takes 0.40 s alone (1.1 s beside them at nice 0), and the nodes still share equally
  among themselves, as on separate machines.

A node lowers its session only when the session is its own (a testnet's nodes, a node
under systemd): a node started from a terminal shares the terminal's session, which it
must not slow down for the shell and whatever runs next in it. `PEERTRAIN_SESSION_NICE`
sets the nice it gives its session (0 leaves the session alone): the test suite sets 0,
whose scenario deadlines were set with every node's session equal to the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from pathlib import Path

log = logging.getLogger("node.process.priority")

TRAINER_NICE = 10
SESSION_NICE_ENV = "PEERTRAIN_SESSION_NICE"  # the session's nice once training; 0: leave it
AUTOGROUP = Path("/proc/self/autogroup")  # "/autogroup-42 nice 0"; Linux only


def lower_thread_priority() -> None:
    """Make the calling (trainer) thread yield the CPU to the node's trio thread.

    Compute is throughput work; the network is latency work. When several processes share
    the cores (a testnet), a trainer preempted while it holds the GIL stalls its trio
    thread until the scheduler comes back to it: measured on 7 digits nodes on 2 cores,
    10-second timeouts on tiny request/response streams and no exchange finishing. With
    the trainer niced (Linux: per thread), a waking trio thread runs at once; on an
    otherwise idle machine the trainer loses nothing.
    """
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TRAINER_NICE)


def session_nice(path: Path = AUTOGROUP) -> int | None:
    """This session's autogroup nice, or None where there is none to read."""
    try:
        return int(path.read_text().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None


def lower_session_priority(path: Path = AUTOGROUP) -> bool:
    """Give this node's session the trainer's nice, if the session is the node's own and
    runs at a higher priority; True when it was lowered. Never raises: a kernel without
    autogroup, or one that refuses, leaves the session as it was."""
    target = session_nice_wanted()
    if target == 0 or os.getsid(0) != os.getpid():
        return False  # not wanted, or a terminal's session, shared with the shell
    nice = session_nice(path)
    if nice is None or nice >= target:
        return False
    if not set_session_nice(path, target):
        return False
    log.info("training: this node's session now runs at nice %d (was %d), so that the "
             "machine's other work goes first", target, nice)
    return True


def session_nice_wanted() -> int:
    """`PEERTRAIN_SESSION_NICE` (0-19), else TRAINER_NICE; a value out of range or not a
    number is logged and ignored."""
    raw = os.environ.get(SESSION_NICE_ENV, "").strip()
    if not raw:
        return TRAINER_NICE
    try:
        value = int(raw)
        if 0 <= value <= 19:
            return value
    except ValueError:
        pass
    log.warning("%s=%r is not a nice value from 0 to 19; using %d", SESSION_NICE_ENV, raw,
                TRAINER_NICE)
    return TRAINER_NICE


def set_session_nice(path: Path, nice: int, tries: int = 20) -> bool:
    """Write the autogroup's nice. Linux lets an unprivileged process change an autogroup's
    nice once per 0.1 s, machine-wide (EAGAIN otherwise): a testnet's nodes all reach
    their first step at about the same moment, so a refusal is tried again."""
    for _ in range(tries):
        try:
            path.write_text(str(nice))
            return True
        except BlockingIOError:  # EAGAIN: another session's change within the last 0.1 s
            time.sleep(0.1 + random.random() * 0.1)
        except OSError as e:
            log.debug("could not lower the session's priority: %s", e)
            return False
    log.debug("could not lower the session's priority: busy %d times", tries)
    return False
