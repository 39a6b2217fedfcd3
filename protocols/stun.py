"""STUN Binding (RFC 5389) messages, sans-IO: the run's own STUN responders and probes.

Publicly reachable peers answer Binding Requests so that peers behind NATs learn their
server-reflexive address for ICE (node/webrtc/), without any server outside the run.
Only what that needs is here: a Binding Request (with the optional RFC 5780
CHANGE-REQUEST the testnet's responder honours), and a Binding Success with
MAPPED-ADDRESS and XOR-MAPPED-ADDRESS. Unknown attributes are skipped; MESSAGE-INTEGRITY
and FINGERPRINT are not checked (a Binding Request for a reflexive address carries no
credentials).

Written here rather than reusing aioice.stun, which aiortc brings: protocols/ stays free of
I/O packages (aioice imports asyncio and the ICE agent), and every length is checked
against the datagram before it is read, which a responder facing the internet needs.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from protocols.errors import RemoteProtocolError

MAGIC = 0x2112A442
HEADER = struct.Struct("!HHI12s")
HEADER_BYTES = HEADER.size  # 20
#: The largest datagram accepted (RFC 5389 section 7.1: fits the 576-byte IPv4 minimum).
MAX_MESSAGE = 548
BINDING_REQUEST, BINDING_SUCCESS = 0x0001, 0x0101
MAPPED_ADDRESS, XOR_MAPPED_ADDRESS, CHANGE_REQUEST = 0x0001, 0x0020, 0x0003
CHANGE_IP, CHANGE_PORT = 0x04, 0x02
_FAMILY = {4: 0x01, 6: 0x02}


@dataclass(frozen=True, slots=True)
class Message:
    kind: int
    txid: bytes
    attributes: tuple[tuple[int, bytes], ...]


@dataclass(frozen=True, slots=True)
class BindingRequest:
    txid: bytes
    change: int = 0  # CHANGE_IP | CHANGE_PORT (RFC 5780), 0 if absent


def parse(data: bytes | memoryview) -> Message:
    """Header and attributes of one STUN message; RemoteProtocolError for anything else."""
    data = bytes(data[: MAX_MESSAGE + 1])
    if len(data) > MAX_MESSAGE:
        raise RemoteProtocolError(f"stun: a message of more than {MAX_MESSAGE} bytes")
    if len(data) < HEADER_BYTES:
        raise RemoteProtocolError(f"stun: {len(data)} bytes, shorter than a header")
    kind, length, cookie, txid = HEADER.unpack_from(data)
    if kind & 0xC000:
        raise RemoteProtocolError("stun: the two top bits of the type are not zero")
    if cookie != MAGIC:
        raise RemoteProtocolError("stun: no magic cookie (not RFC 5389)")
    if length != len(data) - HEADER_BYTES or length % 4:
        raise RemoteProtocolError(f"stun: length {length} does not match the datagram")
    attrs, pos = [], HEADER_BYTES
    while pos < len(data):
        if pos + 4 > len(data):
            raise RemoteProtocolError("stun: a truncated attribute header")
        attr, size = struct.unpack_from("!HH", data, pos)
        end = pos + 4 + size
        if end > len(data):
            raise RemoteProtocolError(f"stun: attribute 0x{attr:04x} runs past the message")
        attrs.append((attr, data[pos + 4 : end]))
        pos = end + (-size % 4)
    return Message(kind, txid, tuple(attrs))


def parse_request(data: bytes | memoryview) -> BindingRequest:
    """A Binding Request, or RemoteProtocolError (a responder drops what does not parse)."""
    msg = parse(data)
    if msg.kind != BINDING_REQUEST:
        raise RemoteProtocolError(f"stun: type 0x{msg.kind:04x} is not a Binding Request")
    change = 0
    for attr, value in msg.attributes:
        if attr == CHANGE_REQUEST:
            if len(value) != 4:
                raise RemoteProtocolError("stun: CHANGE-REQUEST is not 4 bytes")
            change = struct.unpack("!I", value)[0] & (CHANGE_IP | CHANGE_PORT)
    return BindingRequest(msg.txid, change)


def encode_request(txid: bytes, change: int = 0) -> bytes:
    if len(txid) != 12:
        raise ValueError("a STUN transaction id is 12 bytes")
    body = struct.pack("!HHI", CHANGE_REQUEST, 4, change) if change else b""
    return HEADER.pack(BINDING_REQUEST, len(body), MAGIC, txid) + body


def _address(attr: int, ip: str, port: int, txid: bytes) -> bytes:
    addr = ipaddress.ip_address(ip)
    raw = addr.packed
    if attr == XOR_MAPPED_ADDRESS:
        port ^= MAGIC >> 16
        mask = struct.pack("!I", MAGIC) + txid
        raw = bytes(a ^ b for a, b in zip(raw, mask, strict=False))
    value = struct.pack("!BBH", 0, _FAMILY[addr.version], port) + raw
    return struct.pack("!HH", attr, len(value)) + value


def encode_success(txid: bytes, ip: str, port: int) -> bytes:
    """A Binding Success telling the requester its address as we saw it, plain and XOR-ed."""
    body = _address(MAPPED_ADDRESS, ip, port, txid) + _address(XOR_MAPPED_ADDRESS, ip, port, txid)
    return HEADER.pack(BINDING_SUCCESS, len(body), MAGIC, txid) + body


def parse_success(data: bytes | memoryview, txid: bytes) -> tuple[str, int]:
    """The (ip, port) a Binding Success for our request `txid` reports."""
    msg = parse(data)
    if msg.kind != BINDING_SUCCESS:
        raise RemoteProtocolError(f"stun: type 0x{msg.kind:04x} is not a Binding Success")
    if msg.txid != txid:
        raise RemoteProtocolError("stun: an answer to another transaction")
    found = {attr: value for attr, value in msg.attributes}
    for attr in (XOR_MAPPED_ADDRESS, MAPPED_ADDRESS):
        value = found.get(attr)
        if value is None:
            continue
        if len(value) not in (8, 20) or value[1] not in (1, 2) \
                or len(value) != (8 if value[1] == 1 else 20):
            raise RemoteProtocolError("stun: a malformed address attribute")
        port, raw = struct.unpack_from("!H", value, 2)[0], value[4:]
        if attr == XOR_MAPPED_ADDRESS:
            port ^= MAGIC >> 16
            mask = struct.pack("!I", MAGIC) + txid
            raw = bytes(a ^ b for a, b in zip(raw, mask, strict=False))
        return str(ipaddress.ip_address(raw)), port
    raise RemoteProtocolError("stun: a Binding Success without an address")
