"""AutoNAT v1 (py-libp2p's wire format and client), with a dial-back that proves something.

py-libp2p's AutoNAT server dials the requester back with `host.connect()`, which reuses the
connection the request came on: every requester "is reachable" (measured in
../shared/notes/nat.md, pitfall 5: a NATed node advertising its observed address got
PUBLIC 5 times of 5, even on a port nobody listened on). Our server dials back on a
fresh connection instead (`Substrate.probe`: a new TCP connection and a Noise handshake
that proves the requester's key), and only the addresses at the IP it saw the request
come from (py-libp2p's filter; no amplification).

The verdict is ours too: py-libp2p wants 4 servers to agree, which a small swarm never
has. `Verdict.decide` asks for `min(confirmations, voters)` agreeing answers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetStream
from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID, AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2p.host import DialError, Substrate

log = logging.getLogger("node.reach")

PROTOCOL_ID = str(AUTONAT_PROTOCOL_ID)
DIAL_BACK_TIMEOUT_S = 5.0  # per address; a NAT that drops our SYN costs this much
MAX_DIAL_BACK_ADDRS = 4  # we dial at most this many of a requester's addresses
QUERY_TIMEOUT_S = 30.0  # above MAX_DIAL_BACK_ADDRS * DIAL_BACK_TIMEOUT_S


class _FreshDialServer(AutoNATService):
    """py-libp2p's AutoNAT server with the dial-back on a fresh connection."""

    def __init__(self, substrate: Substrate) -> None:
        assert substrate.host is not None
        super().__init__(substrate.host, serve=False)  # type: ignore[arg-type]
        self.substrate = substrate

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        for raw in addrs[:MAX_DIAL_BACK_ADDRS]:
            try:
                addr = str(Multiaddr(raw)).split("/p2p/")[0]
                await self.substrate.probe(peer_id, addr, DIAL_BACK_TIMEOUT_S)
                return raw
            except (DialError, ValueError) as e:
                log.debug("dial-back to %s: %s", peer_id, e)
        return None


def server_handler(substrate: Substrate):
    """The stream handler that answers AutoNAT requests (guarded by the substrate)."""

    async def handle(stream: INetStream) -> None:
        await _FreshDialServer(substrate).handle_stream(stream)

    return handle


@dataclass
class Answer:
    server: str
    status: str  # "reached" | "unreachable" | "refused" | "error"
    detail: str = ""
    addr: str | None = None


async def ask(substrate: Substrate, server: ID, addrs: list[str]) -> Answer:
    """Ask `server` to dial us back at `addrs`."""
    assert substrate.host is not None
    client = AutoNATService(substrate.host, serve=False)  # type: ignore[arg-type]
    name = server.to_base58()
    try:
        status, addr = await client.query_server(
            server, [Multiaddr(a).to_bytes() for a in addrs], timeout=QUERY_TIMEOUT_S)
    except trio.TooSlowError:
        return Answer(name, "error", f"no answer within {QUERY_TIMEOUT_S:g} s")
    except Exception as e:  # protocol not supported, stream reset, garbage
        return Answer(name, "error", str(e) or type(e).__name__)
    if status == Message.OK:
        return Answer(name, "reached", addr=str(Multiaddr(addr)) if addr else None)
    if status == Message.E_DIAL_ERROR:
        return Answer(name, "unreachable", "its dial-back failed")
    if status == Message.E_DIAL_REFUSED:
        return Answer(name, "refused", "none of our addresses is at the IP it sees")
    return Answer(name, "error", f"status {status}")


@dataclass
class Verdict:
    """What a round of AutoNAT answers says about us."""

    answers: list[Answer] = field(default_factory=list)

    def decide(self, confirmations: int) -> str:
        """"public", "private" or "unknown". A server that reached us on a fresh connection
        votes public; one that failed, or could dial none of our addresses (they are not
        at the IP it sees: we are behind a NAT), votes private; errors do not vote."""
        yes = sum(a.status == "reached" for a in self.answers)
        no = sum(a.status in ("unreachable", "refused") for a in self.answers)
        need = min(confirmations, yes + no)
        if need == 0:
            return "unknown"
        if yes >= need and yes > no:
            return "public"
        if no >= need and no > yes:
            return "private"
        return "unknown"
