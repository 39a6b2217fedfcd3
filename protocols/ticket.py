"""Join tickets: a run-id and where to find it, in one string to paste into `node join`.

    ticket  = "pt1" + base58btc(msgpack([run_id, peer_id, [addr, ...]]))
    run_id  = the run-id's 34 multihash bytes (sha2-256)
    peer_id = the serving node's peer id, as bytes (a multihash, at most 64 bytes)
    addr    = a multiaddr string without /p2p/ (e.g. "/ip4/203.0.113.7/tcp/4101"),
              1 to MAX_ADDRS of them, each at most MAX_ADDR_CHARS

Why this shape: a run-id alone is enough on a LAN (mDNS) or for a node that was in the run
before; across the internet a joiner needs one reachable peer, and a ticket carries the
run-id and that peer's addresses together, so nothing can be pasted in the wrong place.
base58 keeps it one word (no '/', '+', '=' or spaces for a chat client to break) and
msgpack keeps it short: ~200 characters with three addresses, where the multiaddrs
spelled out would be ~350. The version is in the prefix: a `pt2` is refused by name, not
misread. Decoding checks the length before any decoding and every size before use.

Sans-IO: strings in, strings out. Whether the addresses answer is for the caller to find.
"""

from __future__ import annotations

from dataclasses import dataclass

import base58
import msgpack

from protocols import multihash

PREFIX = "pt1"
MAX_ADDRS = 8
MAX_ADDR_CHARS = 200
MAX_PEER_ID_BYTES = 64
# 34 + 64 + 8 * 200 bytes of payload plus msgpack headers, in base58 (x1.37), plus slack.
MAX_TICKET_CHARS = 2400
_ADDR_STARTS = ("/ip4/", "/ip6/", "/dns4/", "/dns6/", "/dns/")


class TicketError(ValueError):
    """Not a usable ticket; the message says why."""


@dataclass(frozen=True, slots=True)
class Ticket:
    run_id: str
    peer_id: str
    addrs: tuple[str, ...]  # without /p2p/

    def peer_addrs(self) -> list[str]:
        """The addresses with /p2p/<peer id>: what a node dials."""
        return [f"{a}/p2p/{self.peer_id}" for a in self.addrs]


def _check_addr(addr: object) -> str:
    if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR_CHARS:
        raise TicketError(f"an address must be 1 to {MAX_ADDR_CHARS} characters")
    if not addr.startswith(_ADDR_STARTS) or "/p2p/" in addr or any(c.isspace() for c in addr):
        raise TicketError(f"not a dialable address without /p2p/: {addr[:60]!r}")
    return addr


def encode(run_id: str, peer_id: str, addrs: list[str]) -> str:
    """A ticket for `run_id` served by `peer_id` at `addrs` (/p2p/ suffixes are dropped,
    duplicates too; at most MAX_ADDRS kept)."""
    if not multihash.is_sha256_id(run_id):
        raise TicketError(f"not a run-id: {run_id[:60]!r}")
    peer = base58.b58decode(peer_id)
    if not 0 < len(peer) <= MAX_PEER_ID_BYTES:
        raise TicketError(f"not a peer id: {peer_id[:60]!r}")
    plain = list(dict.fromkeys(a.split("/p2p/")[0] for a in addrs))[:MAX_ADDRS]
    if not plain:
        raise TicketError("a ticket needs at least one address")
    for a in plain:
        _check_addr(a)
    payload = msgpack.packb([base58.b58decode(run_id), peer, plain], use_bin_type=True)
    return PREFIX + base58.b58encode(payload).decode()


def decode(text: str) -> Ticket:
    """Parse a ticket; raises TicketError saying what is wrong."""
    text = text.strip()
    if len(text) > MAX_TICKET_CHARS:
        raise TicketError(f"too long for a ticket ({len(text)} characters, at most "
                          f"{MAX_TICKET_CHARS})")
    if not text.startswith(PREFIX):
        version = text[:3] if text.startswith("pt") else None
        raise TicketError(f"unsupported ticket version {version!r} (this peertrain reads "
                          f"{PREFIX})" if version else "a ticket starts with pt1")
    body = text[len(PREFIX):]
    if not body or not set(body) <= multihash.BASE58_ALPHABET:
        raise TicketError("not base58 after the pt1 prefix (was it cut or wrapped?)")
    try:
        doc = msgpack.unpackb(base58.b58decode(body), raw=False, strict_map_key=True,
                              max_str_len=MAX_ADDR_CHARS, max_bin_len=MAX_PEER_ID_BYTES,
                              max_array_len=MAX_ADDRS, max_map_len=0, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise TicketError(f"damaged ticket ({type(e).__name__})") from None
    if not (isinstance(doc, list) and len(doc) == 3 and isinstance(doc[0], bytes)
            and isinstance(doc[1], bytes) and isinstance(doc[2], list)):
        raise TicketError("damaged ticket (not [run-id, peer-id, addresses])")
    run_raw, peer_raw, addrs = doc
    if len(run_raw) != 34 or run_raw[:2] != multihash.SHA256_PREFIX:
        raise TicketError("damaged ticket (its run-id is not a sha2-256 multihash)")
    if not peer_raw or not addrs:
        raise TicketError("damaged ticket (no peer id or no address)")
    return Ticket(base58.b58encode(run_raw).decode(), base58.b58encode(peer_raw).decode(),
                  tuple(_check_addr(a) for a in addrs))
