"""What each protocol lets a peer make us hold, declared once, beside its PROTOCOL_ID.

A handler that builds its `FrameDecoder` by hand can forget a limit, and one did: the
checkpoint, manifest and meta handlers read requests with the wire format's ceiling of
1 GiB per tensor, so a 60-byte request announcing a 1 GiB tensor cost the node 1 GiB.
Each protocol module therefore declares a `StreamLimits` for what it reads
(`manifest_exchange.REQUEST_LIMITS`, `averaging.LIMITS`, ...), and the adapter in node/
gets its decoder from it (`LIMITS.decoder()`), so the numbers live with the protocol they
bound and the docs table (docs/wire.md) is generated from the same declarations.

Unframed messages (gossip topics, DHT records, SybilWall's history stream) are declared
the same way with `framed=False`: only `max_envelope_bytes` (the whole message) applies.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

from protocols.errors import LocalProtocolError
from protocols.wire import FrameDecoder, TensorHeader


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """The most one stream (or message) of a protocol may make its reader hold or wait for.

    `max_envelope_bytes`: the largest msgpack envelope (the whole message if not `framed`),
    refused on its 4-byte length prefix. `max_tensor_bytes`: the largest tensor payload,
    refused on its header; 0 means the stream never carries a tensor frame, refused on its
    envelope. `codecs`: the tensor payload encodings accepted. `deadline_s`: how long one
    step (a request, a response, a message) may take before the stream is dropped; None
    where the deadline is derived at run time (`note` says from what). `per_value_bytes`:
    a message that carries a model-sized vector (SybilWall histories) may be this many bytes
    longer per model value; `for_model(numel)` gives the limits for one model's size.
    """

    protocol: str
    max_envelope_bytes: int
    max_tensor_bytes: int = 0
    codecs: frozenset[str] = frozenset()
    deadline_s: float | None = None
    framed: bool = True
    per_value_bytes: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        high = 2**32 if self.framed else 2**63  # a frame's length prefix is a u32
        if type(self.max_envelope_bytes) is not int or not 1 <= self.max_envelope_bytes < high:
            raise LocalProtocolError(f"{self.protocol}: max_envelope_bytes out of range")
        if type(self.per_value_bytes) is not int or self.per_value_bytes < 0:
            raise LocalProtocolError(f"{self.protocol}: per_value_bytes must be an int >= 0")
        if type(self.max_tensor_bytes) is not int or self.max_tensor_bytes < 0:
            raise LocalProtocolError(f"{self.protocol}: max_tensor_bytes must be an int >= 0")
        if self.max_tensor_bytes and not self.codecs:
            raise LocalProtocolError(f"{self.protocol}: tensors allowed but no codec")
        if not self.framed and self.max_tensor_bytes:
            raise LocalProtocolError(f"{self.protocol}: an unframed message has no tensors")

    @property
    def tensors_allowed(self) -> bool:
        return self.max_tensor_bytes > 0

    def for_model(self, numel: int) -> StreamLimits:
        """These limits for a model of `numel` values (the receiver's own count, never the
        peer's): the envelope grows by per_value_bytes per value."""
        if type(numel) is not int or numel < 0:
            raise LocalProtocolError(f"numel must be an int >= 0, not {numel!r}")
        return replace(
            self,
            max_envelope_bytes=self.max_envelope_bytes + self.per_value_bytes * numel,
            per_value_bytes=0,
        )

    def decoder(
        self,
        *,
        require_crc32: bool = True,
        payload_buffer: Callable[[TensorHeader], memoryview | None] | None = None,
    ) -> FrameDecoder:
        """A FrameDecoder enforcing exactly these limits: the only way node/ should get one."""
        if not self.framed:
            raise LocalProtocolError(f"{self.protocol} is not a framed stream")
        return FrameDecoder(
            max_frame_bytes=self.max_envelope_bytes,
            max_tensor_bytes=self.max_tensor_bytes,
            allowed_codecs=self.codecs,
            require_crc32=require_crc32,
            payload_buffer=payload_buffer,
        )


#: (module, attribute) of every declaration, in the order docs/wire.md lists them.
DECLARATIONS: Final = (
    ("protocols.manifest_exchange", "REQUEST_LIMITS"),
    ("protocols.manifest_exchange", "RESPONSE_LIMITS"),
    ("protocols.ckpt_exchange", "REQUEST_LIMITS"),
    ("protocols.ckpt_exchange", "RESPONSE_LIMITS"),
    ("protocols.ckpt_exchange", "LANE_HEADER_LIMITS"),
    ("protocols.rundoc", "SYNC_LIMITS"),
    ("protocols.rundoc", "GOSSIP_LIMITS"),
    ("protocols.averaging", "LIMITS"),
    ("protocols.lane", "LIMITS"),
    ("protocols.pipeline", "LIMITS"),
    ("protocols.pipeline", "LANE_REPLY_LIMITS"),
    ("protocols.pipeline", "WEIGHTS_REQUEST_LIMITS"),
    ("protocols.pipeline", "WEIGHTS_RESPONSE_LIMITS"),
    ("protocols.history", "LIMITS"),
    ("protocols.heartbeat", "LIMITS"),
    ("protocols.records", "LIMITS"),
    ("protocols.webrtc_signal", "LIMITS"),
)


def declared() -> list[StreamLimits]:
    """Every protocol's declared limits (imported lazily: averaging pulls in torch)."""
    return [getattr(importlib.import_module(m), a) for m, a in DECLARATIONS]


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,} B"


def markdown_table() -> str:
    """The limits table of docs/wire.md and docs/robustness.md (a test keeps them equal)."""
    rows = [
        "| protocol | largest envelope | largest tensor | tensor in requests? | deadline |",
        "|---|---|---|---|---|",
    ]
    for lim in declared():
        tensor = (
            f"{_size(lim.max_tensor_bytes)} ({', '.join(sorted(lim.codecs))})"
            if lim.tensors_allowed
            else "none"
        )
        deadline = f"{lim.deadline_s:g} s" if lim.deadline_s is not None else ""
        deadline = "; ".join(x for x in (deadline, lim.note) if x) or "none"
        envelope = _size(lim.max_envelope_bytes)
        if lim.per_value_bytes:
            envelope += f" + {lim.per_value_bytes} B per model value"
        if not lim.framed:
            envelope += " (whole message)"
        asks = "yes" if lim.tensors_allowed else "no: refused on its envelope"
        if not lim.framed:
            asks = "n/a (unframed)"
        rows.append(f"| `{lim.protocol}` | {envelope} | {tensor} | {asks} | {deadline} |")
    return "\n".join(rows)
