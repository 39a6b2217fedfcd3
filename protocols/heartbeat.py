"""Heartbeats: each member of a run gossips one every second on `/peertrain/<run-id>/hb/1`.

A heartbeat says who is alive, where to dial them, and a few numbers for `node status`.
It is msgpack, at most MAX_BYTES, and must name the peer that signed the gossip message
(gossipsub's strict signing gives us `from_id`), so nobody can announce someone else.

`(epoch, seq)` orders one peer's heartbeats: `epoch` is when its process started (unix
ms), `seq` counts from 1 in each process. Gossip can deliver a heartbeat minutes late (a
mesh that re-forms re-sends what it cached); the receiver keeps only heartbeats newer than
the last one it took, so a late one cannot bring a killed peer or an old step back.
Heartbeats from senders without an epoch decode with 0 (ordered by seq alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from protocols.errors import RemoteProtocolError
from protocols.limits import StreamLimits

VERSION = 1
MAX_BYTES = 4096
MAX_ADDRS = 8

#: One gossip message, checked on its length before msgpack sees it.
LIMITS = StreamLimits("/peertrain/<run-id>/hb/1", MAX_BYTES, framed=False,
                      note="none: a gossip message arrives whole")


def topic(run_id: str) -> str:
    return f"/peertrain/{run_id}/hb/1"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    peer: str
    seq: int
    addrs: tuple[str, ...] = ()
    role: str = "node"
    device: str = "cpu"
    stats: dict = field(default_factory=dict)  # small numbers: step, loss, ...
    epoch: int = 0  # the sender process's start, unix ms

    @property
    def order(self) -> tuple[int, int]:
        """Later heartbeats of one peer compare greater."""
        return (self.epoch, self.seq)

    def encode(self) -> bytes:
        data = msgpack.packb({"v": VERSION, "peer": self.peer, "seq": self.seq,
                              "addrs": list(self.addrs[:MAX_ADDRS]), "role": self.role,
                              "device": self.device, "stats": self.stats, "epoch": self.epoch})
        if len(data) > MAX_BYTES:
            raise ValueError(f"heartbeat of {len(data)} bytes exceeds {MAX_BYTES}")
        return data


def decode(data: bytes, sender: str) -> Heartbeat:
    """Decode a heartbeat gossiped by `sender`; RemoteProtocolError on anything odd."""
    if len(data) > MAX_BYTES:
        raise RemoteProtocolError(f"heartbeat of {len(data)} bytes exceeds {MAX_BYTES}")
    try:
        doc = msgpack.unpackb(data, max_str_len=MAX_BYTES, max_bin_len=0,
                              max_array_len=64, max_map_len=64)
    except Exception as e:
        raise RemoteProtocolError(f"heartbeat is not msgpack: {e}") from e
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise RemoteProtocolError("heartbeat with an unknown version")
    peer, seq, addrs = doc.get("peer"), doc.get("seq"), doc.get("addrs", [])
    if peer != sender:
        raise RemoteProtocolError(f"heartbeat for {peer!r} gossiped by {sender}")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise RemoteProtocolError("heartbeat seq must be a non-negative int")
    epoch = doc.get("epoch", 0)
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 2**63:
        raise RemoteProtocolError("heartbeat epoch must be a non-negative int")
    if not isinstance(addrs, list) or not all(isinstance(a, str) and len(a) < 256 for a in addrs):
        raise RemoteProtocolError("heartbeat addrs must be a list of short strings")
    role, device = doc.get("role", "node"), doc.get("device", "cpu")
    stats = doc.get("stats", {})
    if not isinstance(role, str) or not isinstance(device, str) or not isinstance(stats, dict):
        raise RemoteProtocolError("heartbeat role/device/stats have the wrong type")
    stats = {str(k)[:32]: v for k, v in stats.items()
             if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    return Heartbeat(peer, seq, tuple(addrs[:MAX_ADDRS]), role[:32], device[:32], stats, epoch)
