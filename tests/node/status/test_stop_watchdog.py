"""A node that does not stop within its grace period says what it waits on, then exits.

Seen: one Ctrl-C of a training node hung over 90 s with no word of why. Here a "node" (a
task running the control service beside a cleanup that cannot be cancelled: a worker
thread that is not abandoned) is cancelled; after the grace period the watchdog reports
the stuck task and the thread, and calls the exit it was given."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import trio

from node.status.control import ControlService
from node.status.stuck import EXIT_STUCK
from tests.conftest import node_context


def stuck_cleanup(release: threading.Event) -> None:
    release.wait()  # a blocking call inside a worker thread that cancellation cannot end


async def run_node(ctx: SimpleNamespace, control: ControlService,
                   release: threading.Event | None) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(control.run, ctx)
        if release is not None:
            async def flush_on_the_way_out() -> None:
                try:
                    await trio.sleep_forever()
                finally:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(stuck_cleanup, release)
            nursery.start_soon(flush_on_the_way_out)
        await trio.sleep(0)
        nursery.cancel_scope.cancel()  # the stop signal


async def test_a_stop_that_hangs_is_reported_and_ends(tmp_path: Path):
    release = threading.Event()
    exits: list[int] = []

    def exit(code: int) -> None:  # stands in for os._exit: record, then unstick the node
        exits.append(code)
        release.set()

    control = ControlService({}, grace_s=0.5, exit=exit)
    ctx = node_context(config={"state_dir": tmp_path})
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:  # the node runs in a task of its own
            nursery.start_soon(run_node, ctx, control, release)
    assert exits == [EXIT_STUCK]


async def test_the_report_names_the_stuck_task_and_thread(tmp_path: Path, caplog):
    release = threading.Event()
    control = ControlService({}, grace_s=0.5, exit=lambda code: release.set())
    ctx = node_context(config={"state_dir": tmp_path})
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:  # the node runs in a task of its own
            nursery.start_soon(run_node, ctx, control, release)
    report = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    assert "did not stop within 0.5 s" in report
    assert "flush_on_the_way_out" in report  # the task, at its await
    assert "stuck_cleanup" in report  # the worker thread's stack


async def test_a_node_that_stops_in_time_is_left_alone(tmp_path: Path):
    exits: list[int] = []
    control = ControlService({}, grace_s=30.0, exit=exits.append)
    ctx = node_context(config={"state_dir": tmp_path})
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_node, ctx, control, None)
    assert control.watchdog is not None
    control.watchdog.join(10.0)  # it saw the node's task end and returned
    assert control.watchdog._thread is not None and not control.watchdog._thread.is_alive()
    assert exits == []
