"""Peers remembered from earlier joins of a run: `state_dir/peers-<run-id>.json`.

Why: a volunteer who joined once should be able to come back with `node join <run-id>`
alone. The run document replica also lists members, but it is signed, large and only
readable once the run is known; this file is small, plain and read before anything
starts. It holds the run's last known members and the bootstrap peers that answered,
newest first, each with the addresses it was reached at.

The file is rewritten atomically (node/files.py) while the node runs and once more as it
stops, in a worker thread: the write's fsync waits for a disk that checkpoints keep busy,
and on the trio thread every node's networking waited with it (py-spy: 3 of a trainer's
~180 busy trio-thread samples in 20 s). Reading it is forgiving: a missing, oversized or
damaged file is logged and read as empty, never an error (it is a hint; the next write
replaces it). Bounds: at most MAX_PEERS peers, MAX_ADDRS addresses each, MAX_FILE_BYTES
read.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from node.files import atomic_write

log = logging.getLogger("node.discovery")

VERSION = 1
MAX_PEERS = 32
MAX_ADDRS = 8
MAX_ADDR_CHARS = 512
MAX_FILE_BYTES = 256 * 1024
#: A peer not seen for this long is dropped from the file.
FORGET_AFTER_S = 14 * 86400.0
STOP_WRITE_S = 5.0  # the write as the node stops waits this long at most


def path_for(state_dir: Path, run_id: str) -> Path:
    return Path(state_dir) / f"peers-{run_id}.json"


def load(state_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """Remembered peers, newest first: [{"peer": id, "addrs": [...], "seen": unix}]."""
    path = path_for(state_dir, run_id)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("cannot read remembered peers %s: %s", path, e.strerror or e)
        return []
    if len(data) > MAX_FILE_BYTES:
        log.warning("ignoring remembered peers %s: larger than %d bytes", path, MAX_FILE_BYTES)
        return []
    try:
        doc = json.loads(data)
        if not (isinstance(doc, dict) and doc.get("version") == VERSION
                and doc.get("run") == run_id and isinstance(doc.get("peers"), list)):
            raise ValueError("not a version-1 peers file of this run")
        return [_entry(p) for p in doc["peers"][:MAX_PEERS]]
    except (ValueError, TypeError, KeyError) as e:
        log.warning("ignoring remembered peers %s: %s", path, e)
        return []


def _entry(p: Any) -> dict[str, Any]:
    peer, addrs, seen = p["peer"], p["addrs"], p["seen"]
    if not (isinstance(peer, str) and 0 < len(peer) <= 128 and isinstance(addrs, list)
            and all(isinstance(a, str) and 0 < len(a) <= MAX_ADDR_CHARS for a in addrs)
            and isinstance(seen, int | float)):
        raise ValueError(f"malformed entry for {str(peer)[:60]!r}")
    return {"peer": peer, "addrs": addrs[:MAX_ADDRS], "seen": float(seen)}


def addresses(peers: list[dict[str, Any]]) -> list[str]:
    """Dialable addresses, newest peer first (each ends in /p2p/<its id>)."""
    out = []
    for p in peers:
        for a in p["addrs"]:
            out.append(a if "/p2p/" in a else f"{a}/p2p/{p['peer']}")
    return out


def merge(old: list[dict[str, Any]], now_seen: dict[str, list[str]], now: float,
          me: str) -> list[dict[str, Any]]:
    """Peers seen now (stamped `now`) over the remembered ones; newest first, bounded."""
    by_peer = {p["peer"]: p for p in old if now - p["seen"] <= FORGET_AFTER_S}
    for peer, addrs in now_seen.items():
        good = [a for a in addrs if isinstance(a, str) and 0 < len(a) <= MAX_ADDR_CHARS
                and not _unroutable(a)]
        if good:
            by_peer[peer] = {"peer": peer, "addrs": good[:MAX_ADDRS], "seen": now}
    by_peer.pop(me, None)
    return sorted(by_peer.values(), key=lambda p: -p["seen"])[:MAX_PEERS]


def _unroutable(addr: str) -> bool:
    """0.0.0.0 and :: are where a peer listens, not where it can be reached."""
    return addr.startswith(("/ip4/0.0.0.0/", "/ip6/::/"))


def save(state_dir: Path, run_id: str, peers: list[dict[str, Any]]) -> None:
    doc = {"version": VERSION, "run": run_id, "peers": peers}
    atomic_write(path_for(state_dir, run_id), json.dumps(doc, indent=1).encode())


class RememberPeers:
    """Keeps the file current: every `interval_s` while the run has members, and as the
    node stops. `seen()` gives peer id -> addresses of the peers worth remembering now
    (the membership view's addresses and the bootstrap peers that answered)."""

    name = "remembered_peers"
    protocols = ()

    def __init__(self, state_dir: Path, run_id: str, me: str,
                 seen: Callable[[], dict[str, list[str]]], interval_s: float = 10.0) -> None:
        self.state_dir, self.run_id, self.me = state_dir, run_id, me
        self.seen = seen
        self.interval_s = interval_s
        self.peers = load(state_dir, run_id)
        self.writes = 0
        self.write_errors = 0

    async def run(self, ctx: object = None, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await trio.sleep(self.interval_s)
                await self.update()
        finally:
            # the last view as we stop: the next join starts from it (a stuck disk does
            # not hold the stop longer than STOP_WRITE_S)
            with trio.move_on_after(STOP_WRITE_S, shield=True):
                await self.update()

    async def update(self) -> None:
        now_seen = self.seen()
        if not now_seen:
            return
        peers = merge(self.peers, now_seen, time.time(), self.me)
        if peers == self.peers:
            return
        try:
            await trio.to_thread.run_sync(save, self.state_dir, self.run_id, peers,
                                          abandon_on_cancel=True)
        except OSError as e:
            self.write_errors += 1
            log.warning("cannot save remembered peers: %s", e.strerror or e)
            return
        self.peers = peers
        self.writes += 1

    def statistics(self) -> dict[str, Any]:
        return {"remembered": len(self.peers), "writes": self.writes,
                "write_errors": self.write_errors}
