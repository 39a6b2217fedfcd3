"""mDNS on the local network: advertise this node, find the others, without any address.

Why our own ~150 lines over zeroconf rather than py-libp2p 0.8.1's `enable_mDNS`: that one
always binds every interface (`Zeroconf()`), so a node listening on loopback only would
still multicast on the LAN (and tests would too); it writes straight into the peerstore
and fires a process-global event; and it advertises the public `_p2p._udp.local.` type,
which draws every IPFS node on the LAN. Here the wire format is the libp2p mDNS spec's
(a DNS-SD service whose TXT `dnsaddr=` entries are our multiaddrs with /p2p/<id>), under a
service type of our own, `_peertrain._udp.local.`, and zeroconf is bound to the
interfaces of the node's listen addresses only: 127.0.0.1 keeps it on loopback, 0.0.0.0
means every interface.

zeroconf runs its own thread (an asyncio loop): browse callbacks arrive there and are
handed to trio through a bounded channel; resolving a name (a blocking call) runs in a
trio worker thread. Bounds: at most MAX_FOUND peers kept, MAX_ADDRS addresses each.

A node of a run also says which (TXT `run=<run-id>`; a bootstrap, the runs it serves),
and a joiner takes only peers of its own run or of none named: a node of another run
on the same LAN or machine (two testnets) answers first as often as not, and a joiner
that entered through it found no manifest and exited "check the run-id". Each call of
`wait_for_peers` hands out the peers found since the last one, so a joiner whose first
peers could not be reached asks again and dials the next ones (node/discovery/sources.py).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

import trio

log = logging.getLogger("node.discovery")

SERVICE_TYPE = "_peertrain._udp.local."
MAX_FOUND = 64
MAX_ADDRS = 8
RESOLVE_TIMEOUT_MS = 2000
MAX_RUNS = 4  # run-ids advertised (a bootstrap may serve several)
CLOSE_S = 5.0


def interfaces_for(listen: list[str]) -> list[str] | None:
    """The IPv4 interface addresses zeroconf should use; None means all of them."""
    ips = []
    for addr in listen:
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            if parts[2] == "0.0.0.0":
                return None
            ips.append(parts[2])
    return ips or None


def advertised(addrs: list[str], interfaces: list[str] | None) -> list[str]:
    """Our multiaddrs as LAN peers can dial them: 0.0.0.0 becomes each interface's IPv4."""
    from node.discovery.addrs import expand_unspecified

    out = expand_unspecified(addrs)
    if interfaces is not None:
        out = [a for a in out if a.split("/")[2] in interfaces]
    return out[:MAX_ADDRS]


class MdnsService:
    """Advertises the node and collects the peers other nodes advertise.

    `wait_for_peers(timeout)` returns the addresses of the peers found and not handed out
    yet, waiting (bounded) for a first one: the daemon uses it as the last bootstrap
    source. Discovery alone dials nothing; only the daemon's connect step does.
    """

    name = "mdns"
    protocols = ()

    def __init__(self, peer_id: str, listen: list[str]) -> None:
        self.peer_id = peer_id
        self.interfaces = interfaces_for(listen)
        self.found: dict[str, list[str]] = {}
        self.runs: dict[str, set[str]] = {}  # peer -> the runs it advertises (none: any)
        self.run_id: str | None = None  # ours, from the context: advertised and looked for
        self.handed: set[str] = set()  # peers wait_for_peers has returned
        self.error: str | None = None
        self.registered = False
        self._changed = trio.Event()
        self._zc: Any = None

    async def run(self, ctx: Any, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        from zeroconf import InterfaceChoice, IPVersion, ServiceBrowser, Zeroconf

        self.run_id = getattr(getattr(ctx, "config", None), "run_id", None)
        send, receive = trio.open_memory_channel[str](MAX_FOUND)
        token = trio.lowlevel.current_trio_token()

        def on_change(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
            if state_change.name != "Added":
                return
            # in zeroconf's thread; a full channel drops (bounded by MAX_FOUND)
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(_offer, send, name, trio_token=token)

        try:
            self._zc = await trio.to_thread.run_sync(lambda: Zeroconf(
                interfaces=self.interfaces or InterfaceChoice.All,
                ip_version=IPVersion.V4Only))
        except OSError as e:
            self.error = f"cannot start mDNS: {e.strerror or e}"
            log.warning("%s; LAN peers will not find this node by itself", self.error)
            task_status.started()
            await trio.sleep_forever()
        zc = self._zc
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._advertise, ctx)
                async for name in receive:
                    if name.split(".")[0] != self.peer_id and len(self.found) < MAX_FOUND:
                        nursery.start_soon(self._resolve, name)
        finally:
            # Says goodbye (peers drop us); bounded: a stop must not wait on zeroconf's loop.
            with trio.move_on_after(CLOSE_S, shield=True):
                browser.cancel()
                await trio.to_thread.run_sync(zc.close, abandon_on_cancel=True)

    async def _advertise(self, ctx: Any) -> None:
        from zeroconf import ServiceInfo

        await ctx.substrate.ready.wait()
        addrs = advertised(ctx.substrate.addrs(), self.interfaces)
        ips = sorted({a.split("/")[2] for a in addrs})
        if not addrs:
            return
        properties = {("dnsaddr" if i == 0 else f"dnsaddr{i + 1}"): a
                      for i, a in enumerate(addrs)}
        # ours, or (a bootstrap) those it serves; TXT entries are short: at most MAX_RUNS
        held = [self.run_id] if self.run_id is not None else _held_runs(ctx)
        for i, run in enumerate(held[:MAX_RUNS]):
            properties["run" if i == 0 else f"run{i + 1}"] = run
        info = ServiceInfo(
            SERVICE_TYPE, f"{self.peer_id}.{SERVICE_TYPE}", port=int(addrs[0].split("/")[4]),
            properties=properties,
            server=f"{self.peer_id[-20:]}.local.",
            addresses=[socket.inet_aton(ip) for ip in ips])
        try:  # probing for name conflicts blocks ~1.5 s: a worker thread, not the loop
            await trio.to_thread.run_sync(self._zc.register_service, info, abandon_on_cancel=True)
        except Exception as e:
            self.error = f"cannot advertise on mDNS: {e}"
            log.warning(self.error)
            return
        self.registered = True
        log.info("advertising on mDNS (%s) as %s", ", ".join(ips), self.peer_id)

    async def _resolve(self, name: str) -> None:
        info = await trio.to_thread.run_sync(
            lambda: self._zc.get_service_info(SERVICE_TYPE, name, timeout=RESOLVE_TIMEOUT_MS),
            abandon_on_cancel=True)
        if info is None:
            return
        addrs = []
        runs = {v.decode(errors="replace")[:64] for k, v in (info.properties or {}).items()
                if isinstance(k, bytes) and k.startswith(b"run") and v}
        for key, value in (info.properties or {}).items():
            if isinstance(key, bytes) and key.startswith(b"dnsaddr") and value:
                try:
                    addrs.append(value.decode()[:512])
                except UnicodeDecodeError:
                    continue
        peer = name.split(".")[0]
        addrs = [a for a in addrs if a.endswith(f"/p2p/{peer}")][:MAX_ADDRS]
        if addrs and peer != self.peer_id:
            new = peer not in self.found
            self.found[peer] = addrs
            self.runs[peer] = set(sorted(runs)[:MAX_RUNS])
            if new:
                log.info("found %s on mDNS at %s%s", peer, " ".join(addrs),
                         "" if self._ours(peer) else
                         f" (runs {' '.join(sorted(self.runs[peer]))}: not ours)")
            self._changed.set()
            self._changed = trio.Event()

    def _ours(self, peer: str) -> bool:
        """A peer a joiner of our run may enter through: of our run, or of none named."""
        runs = self.runs.get(peer)
        return not runs or self.run_id is None or self.run_id in runs

    def _fresh(self) -> list[str]:
        return [p for p in self.found if p not in self.handed and self._ours(p)]

    async def wait_for_peers(self, timeout: float) -> list[str]:
        """Addresses of the peers of our run found and not handed out before, waiting up to
        `timeout` s for one that names our run (a peer that names none, an older node or
        a bootstrap holding no run, may be of another run: it is handed out too, but is
        not what the wait ends on unless the time runs out); [] when none answers."""
        with trio.move_on_after(timeout):
            while not any(self.run_id in self.runs.get(p, ()) for p in self._fresh()):
                await self._changed.wait()
        fresh = sorted(self._fresh(), key=lambda p: self.run_id not in self.runs.get(p, ()))
        self.handed.update(fresh)
        return [a for p in fresh for a in self.found[p]]

    def statistics(self) -> dict[str, Any]:
        return {"interfaces": self.interfaces or "all", "advertising": self.registered,
                "found": sorted(self.found),
                "other_runs": sorted(p for p in self.found if not self._ours(p)),
                "error": self.error}


def _held_runs(ctx: Any) -> list[str]:
    runs = getattr(ctx, "runs", None)
    try:
        return sorted(runs.run_ids()) if runs is not None else []
    except OSError:
        return []


def _offer(send: trio.MemorySendChannel[str], name: str) -> None:
    with contextlib.suppress(trio.WouldBlock):
        send.send_nowait(name)
