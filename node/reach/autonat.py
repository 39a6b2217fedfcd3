"""AutoNAT v1 (py-libp2p's wire format and client), with a dial-back that proves something.

py-libp2p's AutoNAT server dials the requester back with `host.connect()`, which reuses the
connection the request came on: every requester "is reachable" (measured in
../shared/notes/nat.md, pitfall 5: a NATed node advertising its observed address got
PUBLIC 5 times of 5, even on a port nobody listened on). Our server dials back on a
fresh connection instead (`Substrate.probe`: a new TCP connection and a Noise handshake
that proves the requester's key), and only the addresses at the IP it saw the request
come from (py-libp2p's filter; no amplification).

The verdict is ours too (`Window`): py-libp2p wants 4 servers to agree, which a small
swarm never has, and a fixed count of agreeing answers per round never changed its mind
(a public node whose first dial-back failed: two "reached" against one "unreachable" are
not 3 agreeing, so it stayed private). Here each server IP's latest answer is one vote, in
a window of recent answers; servers on our own machine do not vote (a dial-back from our
own IP proves nothing about other machines); the majority decides, either way.
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
    ip: str | None = None  # the server's IP (the connection we asked it on)
    local: bool = False  # the server is on our machine: its answer does not vote
    at: float = 0.0  # when we got it (trio clock)

    @property
    def vote(self) -> str | None:
        """"public", "private" or None. A server that reached us on a fresh connection
        votes public; one that failed, or could dial none of our addresses (they are not
        at the IP it sees: we are behind a NAT), votes private; errors, and servers on our
        own machine, do not vote."""
        if self.local or self.status not in ("reached", "unreachable", "refused"):
            return None
        return "public" if self.status == "reached" else "private"


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
class Window:
    """The recent answers that decide our reachability: one vote per server IP (its
    latest answer; several servers behind one IP, or one server asked again, are one
    voice), at most `size` IPs, none older than `max_age_s`. Pure: no I/O, the clock is
    passed in."""

    size: int = 8
    max_age_s: float = 900.0
    votes: dict[str, Answer] = field(default_factory=dict)  # server IP -> latest answer

    def add(self, answer: Answer, now: float) -> None:
        """Record `answer` (one without a vote or an IP changes nothing)."""
        if answer.vote is None or answer.ip is None:
            return
        answer.at = now
        self.votes.pop(answer.ip, None)
        self.votes[answer.ip] = answer
        while len(self.votes) > self.size:
            self.votes.pop(next(iter(self.votes)))

    def current(self, now: float) -> list[Answer]:
        self.votes = {ip: a for ip, a in self.votes.items() if now - a.at <= self.max_age_s}
        return list(self.votes.values())

    def tally(self, now: float) -> tuple[int, int]:
        """(public votes, private votes) in the window now."""
        votes = [a.vote for a in self.current(now)]
        return votes.count("public"), votes.count("private")

    def decide(self, now: float) -> str:
        """"public" or "private" when one side has more votes, else "unknown" (no votes,
        or a tie)."""
        yes, no = self.tally(now)
        return "public" if yes > no else "private" if no > yes else "unknown"
