"""Garbage that py-libp2p's own handlers swallow, blamed on its sender.

py-libp2p 0.8.1's AutoNAT and identify/push handlers read one length-prefixed protobuf
and, on any error, log an ERROR line and close the stream: the gate (p2p/gate.py) never
heard of it, so garbage cost its sender nothing but a line in our log each time (the
hostile-protocol suite, tests/swarm/test_hostile_protocols.py, found both). The read function
each handler calls is rebound in its module (as p2p/dht.py rebinds KadDHT's) to one that
also parses what it read, and blames the stream's peer (`p2p.blame.blame`, a no-op outside
a guarded handler) for an oversized or undecodable message. The handler still does what
it did; the gate now scores it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import libp2p.host.autonat.autonat as _autonat
import libp2p.identity.identify_push.identify_push as _push
from google.protobuf.message import Message
from libp2p.exceptions import ParseError
from libp2p.host.autonat.pb.autonat_pb2 import Message as AutonatMessage
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.io.exceptions import MessageTooLarge

from p2p.blame import blame

Read = Callable[..., Awaitable[bytes]]

# read_length_prefixed_protobuf raises bare Exceptions; these say the sender lied (the
# others say the stream ended early: churn, not garbage).
_LIES = ("exceeds maximum", "Varint decoding error")

_installed = False


def _screened(read: Read, message: type[Message], what: str) -> Read:
    async def screened(*args: Any, **kwargs: Any) -> bytes:
        try:
            data = await read(*args, **kwargs)
        except (MessageTooLarge, ParseError) as e:
            blame("invalid", f"{what}: {e}")
            raise
        except Exception as e:
            if any(lie in str(e) for lie in _LIES):
                blame("invalid", f"{what}: {e}")
            raise
        try:
            message().ParseFromString(data)
        except Exception as e:
            blame("invalid", f"{what}: not a {message.__name__} message ({e})")
        return data

    return screened


def _rebind(module: ModuleType, name: str, message: type[Message], what: str) -> None:
    setattr(module, name, _screened(getattr(module, name), message, what))


def install() -> None:
    """Rebind the reads (once per process; the gate calls it when it attaches)."""
    global _installed
    if _installed:
        return
    _installed = True
    # AutoNAT's module reads a request (its server) and a response (its client, outside
    # any guarded handler, where blame does nothing).
    _rebind(_autonat, "read_varint_prefixed_bytes_limited", AutonatMessage, "AutoNAT")
    _rebind(_push, "read_length_prefixed_protobuf", Identify, "identify/push")
