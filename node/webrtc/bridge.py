"""One asyncio loop in its own thread, driven from trio: the home of every aiortc object.

aiortc is asyncio-only. Measured (../shared/notes/stack.md §2), a dedicated loop thread
moved data channels 2.5x faster than trio-asyncio and left trio's loop alone. The rule
that keeps it safe: aiortc objects are touched only on this thread, through `run`
(a coroutine, awaited from trio) or `call_soon`; the asyncio side reaches trio only
through a trio token's `run_sync_soon`, never blocking its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import trio

log = logging.getLogger("node.webrtc")
T = TypeVar("T")


class AsyncioThread:
    def __init__(self, name: str = "webrtc-asyncio") -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_log_exception)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def run(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run `fn(*args)` on the asyncio loop and wait for it from trio; cancelling the
        trio side cancels the asyncio task."""
        token, done = trio.lowlevel.current_trio_token(), trio.Event()
        future = asyncio.run_coroutine_threadsafe(fn(*args), self.loop)
        future.add_done_callback(lambda _: _soon(token, done.set))
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        return future.result()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the loop (close the connections on it first, through `run`)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


def _soon(token: trio.lowlevel.TrioToken, fn: Callable[..., Any], *args: Any) -> None:
    """Hand `fn` to trio from the asyncio thread; dropped if trio's run is over."""
    with contextlib.suppress(trio.RunFinishedError):
        token.run_sync_soon(fn, *args)


def _log_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    log.debug("webrtc: asyncio: %s%s", context.get("message"), f" ({exc!r})" if exc else "")
