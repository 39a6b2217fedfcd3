"""Port mappings on the LAN's UPnP gateway (miniupnpc), from trio.

miniupnpc blocks (SSDP discovery waits `discover_ms`; each SOAP call is an HTTP request),
so every call runs in a worker thread, one at a time (the UPnP object is not thread-safe).
A gateway that is absent, refuses or answers nonsense is an `UpnpError` whose message is
the one line a user sees in the log and in `node status`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

import trio

DESCRIPTION = "peertrain"


class UpnpError(Exception):
    """The gateway could not give us a mapping; the message says why."""


@dataclass(frozen=True)
class Mapping:
    external_ip: str
    external_port: int
    internal_ip: str
    internal_port: int
    lease_s: int

    @property
    def multiaddr(self) -> str:
        return f"/ip4/{self.external_ip}/tcp/{self.external_port}"


class Gateway:
    """The IGD that answered our discovery; `discover()` first."""

    def __init__(self, discover_ms: int = 2000) -> None:
        self.discover_ms = discover_ms
        self._upnp: Any = None
        self._lock = trio.Lock()
        self.url: str | None = None

    async def _call(self, fn, *args):
        async with self._lock:
            return await trio.to_thread.run_sync(fn, *args)

    async def discover(self) -> str:
        """Find the gateway; returns its control URL."""
        try:
            import miniupnpc
        except ImportError as e:
            raise UpnpError(f"miniupnpc is not installed ({e})") from None

        def find() -> str:
            u = miniupnpc.UPnP()
            u.discoverdelay = self.discover_ms
            try:
                found = u.discover()
            except Exception:  # miniupnpc raises Exception("Success") when none answers
                found = 0
            if found == 0:
                raise UpnpError(f"no UPnP gateway answered on the LAN within "
                                f"{self.discover_ms / 1000:g} s")
            try:
                url = u.selectigd()
            except Exception as e:  # miniupnpc raises plain Exception with a message
                raise UpnpError(f"no usable UPnP gateway ({e})") from None
            self._upnp = u
            return str(url)

        self.url = await self._call(find)
        return self.url

    async def map(self, port: int, lease_s: int) -> Mapping:
        """Map external TCP `port` to our `port`; the same call renews it."""
        u = self._upnp
        if u is None:
            raise UpnpError("no gateway discovered")

        def add() -> Mapping:
            try:
                external_ip = str(u.externalipaddress())
                ipaddress.IPv4Address(external_ip)
            except Exception as e:
                raise UpnpError(f"the gateway gave no usable external address ({e})") from None
            try:
                ok = u.addportmapping(port, "TCP", u.lanaddr, port, DESCRIPTION, "", lease_s)
            except Exception as e:
                raise UpnpError(f"the gateway refused to map TCP port {port} ({e})") from None
            if not ok:
                raise UpnpError(f"the gateway refused to map TCP port {port}")
            return Mapping(external_ip, port, str(u.lanaddr), port, lease_s)

        return await self._call(add)

    async def unmap(self, mapping: Mapping) -> None:
        u = self._upnp
        if u is None:
            return

        def delete() -> None:
            try:
                u.deleteportmapping(mapping.external_port, "TCP")
            except Exception as e:
                raise UpnpError(f"the gateway did not remove port {mapping.external_port} "
                                f"({e})") from None

        await self._call(delete)
