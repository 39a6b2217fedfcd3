"""A pipeline whose steps stop completing says so (node/pipe/stall.py), naming the stage
it waits for; real stage workers in threads, real torch. Time past the threshold is given
to `stall.current` as `now`, never slept."""

from __future__ import annotations

import threading
import time

from node.pipe import stall
from node.pipe.stall import StallWatch
from tests.conftest import wait_until
from tests.node.pipe.test_pipe_links import wire_pipeline

SMAP = [["a"], ["b"], ["c"]]


def phase(worker, now: float | None = None, smap=SMAP) -> str:
    return stall.current("training", 0.0, worker.progress.phase, worker.watch,
                         worker.wait_s(), smap, now)[0]


def test_a_worker_waiting_past_its_deadlines_is_stalled_on_the_stage_it_waits_for():
    workers, progress, stop = wire_pipeline(3)
    for w in workers:
        w.first_wait_s = 600.0  # no deadline expires while the test looks
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers[:2]]
    for t in threads:  # stage 2 does not run: its inbox fills, nothing comes back
        t.start()
    try:
        driver, middle, last = workers
        wait_until(lambda: middle.watch.awaiting == 2 and driver.watch.awaiting == 1,
                   60, "the middle stage to wait for stage 2's gradients")
        assert phase(middle) == phase(driver) == "training"  # within the deadlines
        past = stall.STALL_DEADLINES * middle.wait_s() + 40  # 1240 s before a first step
        later = middle.watch.last_trained + past
        assert phase(middle, later) == f"stalled: waiting for stage 2 since {past:.0f} s"
        assert phase(driver, later).startswith("stalled: waiting for stage 1 since ")
        # a stage with no live host is named first: nothing completes without it
        assert phase(driver, later, [["a"], ["b"], []]).startswith(
            "stalled: waiting for stage 2 (no live host) since ")
        assert last.watch.loss_at is None and stall.loss_age(last.watch) is None

        threads.append(threading.Thread(target=last.run, daemon=True))
        threads[-1].start()  # stage 2 comes back: steps complete again
        wait_until(lambda: progress[0].step >= 2 and last.watch.loss_at is not None,
                   120, "steps through the returned stage 2")
        assert phase(driver) == phase(middle) == phase(last) == "training"
        assert 0 <= stall.loss_age(last.watch) < 120
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def test_one_lost_step_is_not_a_stall_and_a_recovery_says_how_long_it_has_lasted():
    watch = StallWatch(last_trained=100.0, awaiting=3)
    # one deadline with nothing trained: a drop, not yet a stall
    assert stall.current("training", 0.0, "training", watch, 5.0, [["a"]] * 4, 108.0) \
        == ("training", None)
    text, st = stall.current("training", 0.0, "training", watch, 5.0, [["a"]] * 4, 131.0)
    assert text == "stalled: waiting for stage 3 since 31 s"
    assert st is not None and st.to_json() == {"stages": [3], "since_s": 31.0,
                                               "no_host": False, "queued": 0}
    # what it waits for has come: this host is behind (a starved trainer thread)
    assert stall.current("training", 0.0, "training", watch, 5.0, [["a"]] * 4, 131.0,
                         queued=21)[0] == "stalled: 21 messages queued on this host since 31 s"
    assert stall.current("training", 0.0, "training", watch, 5.0,
                         [["a"], [], ["b"], []], 131.0)[0] \
        == "stalled: waiting for stages 1, 3 (no live host) since 31 s"
    # a stage with no host: at once, within the deadlines (nothing can complete)
    assert stall.current("training", 0.0, "training", watch, 5.0,
                         [["a"], [], ["b"], ["c"]], 101.0)[0] \
        == "stalled: waiting for stage 1 (no live host) since 1 s"
    assert stall.current("recovering stage 2", 90.0, "training", None, 0.0, [], 102.4) \
        == ("recovering stage 2 since 12 s", None)
    assert stall.current("training", 0.0, "failed", watch, 5.0, [], 500.0)[0] == "failed"
    now = time.monotonic()
    assert stall.current("training", 0.0, "training", StallWatch(last_trained=now), 5.0,
                         [["a"]], now + 1)[0] == "training"


def test_phase_classes_are_few():
    assert stall.phase_class("stalled: waiting for stage 2 since 40 s") == "stalled"
    assert stall.phase_class("recovering stage 12 since 3 s") == "recovering"
    assert stall.phase_class("training") == "training"
    assert stall.phase_class("waiting for stages") == "waiting for stages"
