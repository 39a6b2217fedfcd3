"""One host of the reachability benchmark (testnet/bench/reach.py), run inside a namespace.

It runs a real Substrate with the node's reach services on it (reachability + UPnP, relay,
hole punching, paths: the same classes the daemon runs) and takes JSON commands, one per
line on stdin, answering one JSON line each on stdout:

* `{"cmd": "reset"}`: a fresh identity and listen port (a node seen for the first time;
  no TIME_WAIT or conntrack state left from the last attempt), connected to the relays;
* `{"cmd": "state", "peer": id}`: reachability, reservations, addresses, the path to
  `peer` and its punch state;
* `{"cmd": "dial", "peer": id, "addrs": [...]}`: dial like a node's redialer (each
  address in order, 5 s each: direct ones first, relayed last) and from then on record
  every change of the path to `peer`, with the time since the dial began;
* `{"cmd": "timeline", "peer": id}`: what that recording holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from types import SimpleNamespace
from typing import Any

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.reach.paths import PathService
from node.reach.punch import HolePunchService
from node.reach.relays import RelayService
from node.reach.service import ReachabilityService
from p2p.host import DialError, Substrate

DIAL_TIMEOUT_S = 5.0  # the redialer's


class Incarnation:
    """One identity on one port with its services; replaced on each reset."""

    def __init__(self, ip: str) -> None:
        self.sub = Substrate(create_new_key_pair(), [f"/ip4/{ip}/tcp/0"])
        self.reach = ReachabilityService(retry_s=2.0)
        self.relay = RelayService(self.reach.verdict, tick_s=0.5, retry_s=10.0)
        self.punch = HolePunchService(self.reach.verdict, tick_s=0.5)
        self.paths = PathService([self.punch.label], upnp_mapped=self.reach.mapped,
                                 every_s=5.0)
        self.timelines: dict[str, dict[str, Any]] = {}
        self.scope = trio.CancelScope()

    async def run(self, relays: list[str], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.sub.serve)
                ctx = SimpleNamespace(substrate=self.sub)
                for svc in (self.reach, self.relay, self.punch, self.paths):
                    await nursery.start(svc.run, ctx)
                for addr in relays:
                    try:
                        await self.sub.connect(addr, timeout=10)
                    except DialError as e:
                        logging.warning("relay %s: %s", addr, e)
                self.nursery = nursery
                task_status.started()

    async def close(self) -> None:
        """Close every connection (peers see it go, and a relay frees our slot), then
        stop. Cancelling alone left the sockets open: the relays counted the old
        identities as connected and their slots as taken."""
        host = self.sub.host
        if host is not None:
            with trio.move_on_after(5):
                await host.get_network().close()
        self.scope.cancel()

    def state(self, peer: str | None) -> dict[str, Any]:
        path = self.paths.paths().get(peer) if peer else None
        return {"peer_id": self.sub.peer_id.to_base58(), "addrs": self.sub.addrs(),
                "reach": self.reach.state, "via": self.reach.via,
                "reservations": len(self.relay.held), "path": path,
                "punch": (self.punch.statistics()["peers"].get(peer) if peer else None),
                "role": self.punch.roles.get(peer) if peer else None}

    def dial(self, peer: str, addrs: list[str]) -> None:
        tl: dict[str, Any] = {"transitions": [], "dialed": None, "errors": []}
        self.timelines[peer] = tl
        self.nursery.start_soon(self._dial, peer, addrs, tl)

    async def _dial(self, peer: str, addrs: list[str], tl: dict[str, Any]) -> None:
        start = time.monotonic()

        async def watch() -> None:
            last = None
            while True:
                path = self.paths.paths().get(peer)
                if path != last:
                    tl["transitions"].append([round(time.monotonic() - start, 3), path])
                    last = path
                await trio.sleep(0.05)

        self.nursery.start_soon(watch)
        for addr in addrs:
            try:
                await self.sub.connect(addr, timeout=DIAL_TIMEOUT_S)
            except DialError as e:
                tl["errors"].append(str(e))
                continue
            tl["dialed"] = [round(time.monotonic() - start, 3), addr]
            return


async def main(ip: str, relays: list[str]) -> None:
    current: Incarnation | None = None
    outer: trio.Nursery
    async with trio.open_nursery() as outer:
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                break
            req = json.loads(line)
            cmd = req.get("cmd")
            out: dict[str, Any]
            try:
                if cmd == "reset":
                    if current is not None:
                        await current.close()
                    current = Incarnation(ip)
                    await outer.start(current.run, relays)
                    out = current.state(None)
                elif current is None:
                    out = {"error": "reset first"}
                elif cmd == "state":
                    out = current.state(req.get("peer"))
                elif cmd == "dial":
                    current.dial(req["peer"], req["addrs"])
                    out = {"ok": True}
                elif cmd == "timeline":
                    out = current.timelines.get(req["peer"], {})
                else:
                    out = {"error": f"unknown command {cmd!r}"}
            except Exception as e:
                out = {"error": repr(e)}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
        outer.cancel_scope.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ip", required=True)
    ap.add_argument("--relays", default="")
    ap.add_argument("--log", default=None)
    a = ap.parse_args()
    logging.basicConfig(filename=a.log, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    trio.run(main, a.ip, [r for r in a.relays.split(",") if r])
