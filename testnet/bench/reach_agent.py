"""One host of the reachability benchmark (testnet/bench/reach.py), run inside a namespace.

It runs a real Substrate with the node's reach services on it (reachability + UPnP, relay,
hole punching, paths: the same classes the daemon runs) and takes JSON commands, one per
line on stdin, answering one JSON line each on stdout:

* `{"cmd": "reset"}`: a fresh identity and listen port (a node seen for the first time;
  no TIME_WAIT or conntrack state left from the last attempt), connected to the relays;
  options: `"punch": false` (no hole punching), `"webrtc": true` (the webrtc service, as
  a node runs it), `"average": true` (the averaging service, for `exchange`: imports
  torch);
* `{"cmd": "state", "peer": id}`: reachability, reservations, addresses, the path to
  `peer` and its punch state;
* `{"cmd": "dial", "peer": id, "addrs": [...]}`: dial like a node's redialer (each
  address in order, 5 s each: direct ones first, relayed last) and from then on record
  every change of the path to `peer`, with the time since the dial began;
* `{"cmd": "timeline", "peer": id}`: what that recording holds;
* `{"cmd": "exchange", "peer": id, "round": r, "mb": MB}`: one averaging round with
  `peer` (who must be told the same at the same time) of MB megabytes of fp32 weights
  under `outer.codec = "auto"`, answered when it is over: whether it returned the
  other's vector, its seconds, the codec, and the bytes by route (lane, stream, webrtc).
  `step_s` and `inner_steps` set the round's boundary slack as a run's would
  (node/averaging/service.py `deadline`).

`node bench reach` uses the first four; `node bench paths` (testnet/bench/paths.py) all.
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
from node.webrtc.service import WebRtcService
from p2p.host import DialError, Substrate

DIAL_TIMEOUT_S = 5.0  # the redialer's


class Incarnation:
    """One identity on one port with its services; replaced on each reset."""

    def __init__(self, ip: str, *, punch: bool = True, webrtc: bool = False,
                 average: bool = False) -> None:
        self.sub = Substrate(create_new_key_pair(), [f"/ip4/{ip}/tcp/0"])
        self.reach = ReachabilityService(retry_s=2.0)
        self.relay = RelayService(self.reach.verdict, tick_s=0.5, retry_s=10.0)
        self.punch = HolePunchService(self.reach.verdict, tick_s=0.5)
        self.paths = PathService([self.punch.label], upnp_mapped=self.reach.mapped,
                                 every_s=5.0)
        self.webrtc = WebRtcService(self.reach.verdict) if webrtc else None
        self.services: list[Any] = [self.reach, self.relay, *([self.punch] if punch else []),
                                    self.paths, *([self.webrtc] if self.webrtc else [])]
        self.averager: Any = None
        self.partner: list[str] = []
        self.step_s = 0.5  # the trainer's step time the averager's deadlines assume
        if average:
            self._averager()
        self.timelines: dict[str, dict[str, Any]] = {}
        self.scope = trio.CancelScope()

    def _averager(self) -> None:
        """The node's averaging service as a daemon builds it for `outer.codec = "auto"`
        (node/daemon.py): streams through the webrtc service, lanes on direct paths."""
        from node.averaging import adapt
        from node.averaging.service import Averager
        from node.transport.transports import Transports

        door = Transports(self.sub)
        door.attach(channels=self.webrtc, kinds=self.paths,
                    lane_dialable=self.reach.lane_dialable)
        self.averager = Averager(
            self.sub, "bench", self.sub.peer_id.to_base58(), lambda: self.partner,
            codecs=adapt.supported(adapt.AUTO), auto_codec=True,
            step_time=lambda: self.step_s, transports=door)
        self.services.append(self.averager)

    async def run(self, relays: list[str], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.sub.serve)
                ctx = SimpleNamespace(substrate=self.sub)
                for svc in self.services:
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

    def path(self, peer: str) -> str | None:
        """The path as `node status` shows it: webrtc while a data channel carries it."""
        rtc = self.webrtc.paths().get(peer) if self.webrtc is not None else None
        return rtc or self.paths.paths().get(peer)

    def state(self, peer: str | None) -> dict[str, Any]:
        path = self.path(peer) if peer else None
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
                path = self.path(peer)
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

    async def exchange(self, peer: str, r: int, mb: float, step_s: float, inner_steps: int
                       ) -> dict[str, Any]:
        """One averaging round with `peer` (see the module docstring)."""
        import torch

        if self.averager is None:
            return {"error": "reset with \"average\": true first"}
        self.partner[:] = [peer]
        self.step_s, self.averager.inner_steps = step_s, inner_steps
        vec = torch.randn(int(mb * 1e6 / 4), generator=torch.Generator().manual_seed(r))
        path = self.path(peer)
        before = self.averager.partners.get(peer)
        sent0 = dict(before.sent) if before else {}
        t0 = time.monotonic()
        outcome = await self.averager.exchange(r, vec)
        seconds = time.monotonic() - t0
        st = self.averager.partners.get(peer)
        routes = {k: v - sent0.get(k, 0) for k, v in (st.sent if st else {}).items()
                  if v - sent0.get(k, 0)}
        return {"ok": bool(outcome.partner_thetas), "seconds": round(seconds, 3),
                "path": path, "codec": st.last_codec if st else None, "sent": routes,
                "deadline_s": round(self.averager.deadline(peer, vec.numel()), 2),
                "lane_failed": peer in self.averager.lane_failed}


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
                    current = Incarnation(ip, punch=req.get("punch", True),
                                          webrtc=req.get("webrtc", False),
                                          average=req.get("average", False))
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
                elif cmd == "exchange":
                    out = await current.exchange(req["peer"], int(req["round"]),
                                                 float(req["mb"]), float(req.get("step_s", 0.5)),
                                                 int(req.get("inner_steps", 50)))
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
