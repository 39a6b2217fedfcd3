"""The local control endpoint that `node status` reads.

A TCP listener on 127.0.0.1 with an OS-chosen port; the port and a random token are written
to `state_dir/control.json` (mode 0600), so only someone who can read the node's state
directory can talk to it. One JSON request line, one JSON response line.

A testnet node in a network namespace of its own (testnet/netns.py) listens on that
namespace's loopback; the launcher names the namespace in PEERTRAIN_NETNS, the node writes
it into control.json, and the client connects from a thread that entered it (root only,
like the namespaces themselves).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.status import stuck

if TYPE_CHECKING:
    from node.service import NodeContext

CONTROL_FILE = "control.json"
MAX_REQUEST = 4096
NETNS_ENV = "PEERTRAIN_NETNS"
_CLONE_NEWNET = 0x40000000


class ControlUnavailable(Exception):
    """No node answers for this state directory."""


class ControlService:
    """The control endpoint as a node service: one handler per command."""

    name = "control"
    protocols = ()  # a local TCP socket, not a libp2p protocol

    def __init__(self, handlers: dict[str, Callable[[], Any]], *,
                 grace_s: float = stuck.GRACE_S, exit: Callable[[int], Any] = os._exit) -> None:
        self.handlers = handlers
        self.grace_s = grace_s
        self._exit = exit
        self.watchdog: stuck.StopWatchdog | None = None

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # The task that runs the node (it opened the nursery this service runs in): once the
        # node is stopping, a watchdog waits for it to end (node/status/stuck.py).
        parent = trio.lowlevel.current_task().parent_nursery
        owner = parent.parent_task if parent is not None else trio.lowlevel.current_task()
        self.watchdog = stuck.StopWatchdog(owner, self.grace_s, self._exit)
        try:
            await serve_control(ctx.config.state_dir, self.handlers, task_status=task_status)
        except BaseException:  # cancelled (the node stops; maybe in a group) or failing
            self.watchdog.arm()
            raise

    def statistics(self) -> dict[str, Any]:
        return {"commands": sorted(self.handlers)}


async def serve_control(state_dir: Path, handlers: dict[str, Callable[[], Any]], *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    token = secrets.token_hex(16)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    path = Path(state_dir) / CONTROL_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    info = {"port": port, "token": token, "pid": os.getpid()}
    if os.environ.get(NETNS_ENV):
        info["netns"] = os.environ[NETNS_ENV]
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)

    async def handle(conn: trio.SocketStream) -> None:
        async with conn:
            buf = b""
            with trio.move_on_after(5):
                while b"\n" not in buf and len(buf) < MAX_REQUEST:
                    chunk = await conn.receive_some(MAX_REQUEST)
                    if not chunk:
                        break
                    buf += chunk
            try:
                request = json.loads(buf.split(b"\n", 1)[0])
                if not secrets.compare_digest(str(request.get("token", "")), token):
                    reply: Any = {"error": "bad token"}
                elif request.get("cmd") not in handlers:
                    reply = {"error": f"unknown command {request.get('cmd')!r}"}
                else:
                    reply = {"ok": handlers[request["cmd"]]()}
            except (ValueError, AttributeError) as e:
                reply = {"error": f"bad request: {e}"}
            with contextlib.suppress(trio.BrokenResourceError):
                await conn.send_all(json.dumps(reply, default=str).encode() + b"\n")

    try:
        await trio.serve_listeners(handle, listeners, task_status=task_status)  # type: ignore[arg-type]
    finally:
        path.unlink(missing_ok=True)


def query_control(state_dir: Path, cmd: str = "status", timeout: float = 3.0) -> Any:
    """Blocking client for the CLI; raises ControlUnavailable with a reason."""
    path = Path(state_dir) / CONTROL_FILE
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise ControlUnavailable(f"no node is running with state directory {state_dir}") from None
    except (OSError, ValueError) as e:
        raise ControlUnavailable(f"cannot read {path}: {e}") from e
    def ask() -> bytes:
        with socket.create_connection(("127.0.0.1", int(info["port"])), timeout=timeout) as s:
            s.sendall(json.dumps({"token": info["token"], "cmd": cmd}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
            return data

    try:
        data = _in_netns(str(info["netns"]), ask) if info.get("netns") else ask()
    except OSError as e:
        raise ControlUnavailable(
            f"the node for {state_dir} does not answer ({e}); it may have exited") from e
    reply = json.loads(data)
    if "error" in reply:
        raise ControlUnavailable(reply["error"])
    return reply["ok"]


def _in_netns(name: str, fn: Callable[[], bytes]) -> bytes:
    """Run `fn` in a new thread that entered network namespace `name`: setns(2) moves only
    the calling thread, so the caller stays where it is."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise OSError(f"bad namespace name {name!r} in control.json")
    result: dict[str, object] = {}

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"cannot enter network namespace {name}: "
                                       f"{os.strerror(err)}")
            finally:
                os.close(fd)
            result["data"] = fn()
        except OSError as e:
            result["error"] = e

    thread = threading.Thread(target=target, name=f"netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["data"]  # type: ignore[return-value]
