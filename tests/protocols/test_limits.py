"""protocols/limits.py and what it is for: a small request never costs a large allocation.

The regression these tests pin: a request stream on /peertrain/ckpt, /manifest or /meta
that began with a valid tensor header announcing 1 GiB made the node allocate 1 GiB at
once (eight such streams: 545 MB -> 6.6 GB). Memory is measured with tracemalloc, which
sees every Python allocation (bytearray included), not with wall-clock or RSS.
"""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch

from protocols import averaging as av
from protocols import ckpt_exchange as cx
from protocols import codecs, history, limits, rundoc
from protocols import manifest_exchange as mx
from protocols.checkpoint import CHUNK_BYTES
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.limits import StreamLimits
from protocols.wire import (
    NEED_DATA,
    Envelope,
    FrameDecoder,
    TensorFrame,
    encode_envelope,
    encode_tensor_frame,
    make_tensor_header,
    tensor_from_payload,
    tensor_payload,
)

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
REQUEST_LIMITS = {
    "manifest": mx.REQUEST_LIMITS,
    "ckpt": cx.REQUEST_LIMITS,
    "meta": rundoc.SYNC_LIMITS,
}


def tensor_header_frame(length: int, codec: str = "raw", name: str = "w") -> bytes:
    """A valid tensor frame's prefix and envelope announcing `length` payload bytes (a raw
    float32 vector of length / 4 values), without the payload."""
    header = {"name": name, "dtype": "float32", "shape": [length // 4], "codec": codec,
              "length": length, "crc32": 0}
    packed = msgpack.packb({"v": 1, "t": "tensor", "id": 1, "b": header}, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed


@contextmanager
def traced() -> Iterator[Callable[[], tuple[int, int]]]:
    """tracemalloc on for the block; yields (current, peak) bytes since it started."""
    tracemalloc.start()
    try:
        yield tracemalloc.get_traced_memory
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", sorted(REQUEST_LIMITS))
def test_a_1_gib_tensor_header_on_a_request_stream_is_refused_before_allocating(
    name: str,
) -> None:
    limits_ = REQUEST_LIMITS[name]
    assert not limits_.tensors_allowed
    decoder = limits_.decoder()
    decoder.feed(tensor_header_frame(GIB))
    with traced() as memory:
        with pytest.raises(RemoteProtocolError, match="carries none"):
            decoder.next_event()
        _, peak = memory()
    assert peak < 1 << 20


def test_every_stream_that_takes_no_tensors_refuses_one_on_its_envelope() -> None:
    for lim in limits.declared():
        if not lim.framed or lim.tensors_allowed:
            continue
        for length in (0, 16, GIB):  # even an empty tensor: the stream carries none
            decoder = lim.decoder()
            decoder.feed(tensor_header_frame(length))
            with pytest.raises(RemoteProtocolError, match="max_tensor_bytes=0"):
                decoder.next_event()


def test_a_header_announcing_1_gib_allocates_nothing_where_tensors_are_allowed() -> None:
    """The wire format's own ceiling (1 GiB) admits the header; the buffer still waits for
    the bytes. This is the allocation the issue measured (bytearray(n) zero-fills n)."""
    decoder = FrameDecoder()  # max_tensor_bytes = 1 GiB
    decoder.feed(tensor_header_frame(GIB))
    with traced() as memory:
        assert decoder.next_event() is NEED_DATA
        decoder.feed(bytes(1000))
        assert decoder.next_event() is NEED_DATA
        _, peak = memory()
    assert peak < 1 << 20


def test_a_trickled_payload_grows_the_buffer_only_as_bytes_arrive() -> None:
    size, piece = 8 << 20, 64 << 10
    payload = bytes(range(256)) * (size // 256)
    header = make_tensor_header("w", "float32", [size // 4], "raw", payload)
    prefix, view = encode_tensor_frame(header, payload)
    decoder = StreamLimits("test", 4096, size, frozenset({"raw"})).decoder()
    decoder.feed(prefix)
    with traced() as memory:
        arrived = 0
        while arrived < size:
            assert decoder.next_event() is NEED_DATA
            decoder.feed(view[arrived : arrived + piece])
            arrived += piece
            current, peak = memory()
            # bytearray over-allocates by 1/8 when it grows; 64 KiB of slack besides
            assert peak <= arrived * 9 // 8 + (64 << 10), (arrived, current, peak)
        frame = decoder.next_event()
        _, peak = memory()
    assert isinstance(frame, TensorFrame) and frame.payload == payload
    assert peak <= size * 9 // 8 + (64 << 10)


def test_a_legitimate_tensor_still_decodes_under_its_protocols_limits() -> None:
    t = torch.randn(1000)
    dtype, shape, view = tensor_payload(t)
    wire = b"".join(
        bytes(p) for p in encode_tensor_frame(make_tensor_header("w", dtype, shape, "raw", view),
                                              view)
    )
    decoder = StreamLimits("test", 4096, 4000, frozenset({"raw"})).decoder()
    for i in range(0, len(wire), 7):  # in small pieces
        decoder.feed(wire[i : i + 7])
    frame = decoder.next_event()
    assert isinstance(frame, TensorFrame)
    assert torch.equal(tensor_from_payload(frame.header, frame.payload), t)
    over = StreamLimits("test", 4096, 3999, frozenset({"raw"})).decoder()
    over.feed(wire)
    with pytest.raises(RemoteProtocolError, match="exceeds max_tensor_bytes=3999"):
        over.next_event()


def test_averaging_limits_admit_the_largest_chunk_of_every_codec_and_no_more() -> None:
    for codec in codecs.CODECS:
        largest = codecs.max_encoded_size(codec, av.MAX_CHUNK_ELEMS)
        assert largest <= av.LIMITS.max_tensor_bytes
        decoder = av.LIMITS.decoder()
        decoder.feed(tensor_header_frame(av.LIMITS.max_tensor_bytes + 4, codec=codec))
        with pytest.raises(RemoteProtocolError, match="exceeds max_tensor_bytes"):
            decoder.next_event()


def test_legitimate_requests_and_responses_fit_their_limits() -> None:
    """The declared limits keep today's traffic: the largest honest message of each kind."""
    run_id = "Q" * 64  # longer than any real run-id or cid
    cases: list[tuple[StreamLimits, bytes]] = [
        (mx.REQUEST_LIMITS, mx.encode_request(2**62, run_id)),
        (mx.RESPONSE_LIMITS, mx.encode_response(1, run_id, bytes(64 * 1024))),
        (cx.REQUEST_LIMITS, cx.request_manifest(2**62, run_id)),
        (cx.REQUEST_LIMITS, cx.request_chunk(2**62, run_id, (1 << 24) - 1)),
        (cx.RESPONSE_LIMITS, cx.respond(Envelope("ckpt.chunk", 1, {"cid": run_id}),
                                        bytes(CHUNK_BYTES), 7)),
        (rundoc.SYNC_LIMITS, encode_envelope(
            Envelope("meta.delta", 1, {"delta": bytes(rundoc.MAX_DELTA_BYTES),
                                       "summary": bytes(64 + 10 * rundoc.BUCKETS)}),
            max_frame_bytes=rundoc.SYNC_LIMITS.max_envelope_bytes)),
    ]
    for lim, wire in cases:
        decoder = lim.decoder()
        decoder.feed(wire)
        assert isinstance(decoder.next_event(), Envelope), lim.protocol


def test_history_limits_grow_with_the_receivers_model() -> None:
    n = 1000
    assert history.max_message_bytes(n) == history.LIMITS.for_model(n).max_envelope_bytes
    assert history.LIMITS.for_model(n).max_envelope_bytes == 4 * n + 704
    with pytest.raises(LocalProtocolError):
        history.LIMITS.for_model(-1)
    with pytest.raises(LocalProtocolError, match="not a framed stream"):
        history.LIMITS.decoder()


def test_declarations_are_well_formed() -> None:
    modules = {"manifest": mx, "ckpt": cx, "meta": rundoc, "avg": av, "sybilwall": history}
    declared = limits.declared()
    assert len({lim.protocol for lim in declared}) == len(declared)
    for mod in modules.values():  # each lives beside the PROTOCOL_ID it bounds
        assert any(lim.protocol.startswith(mod.PROTOCOL_ID) for lim in declared)
    with pytest.raises(LocalProtocolError):
        StreamLimits("x", 0)
    with pytest.raises(LocalProtocolError):
        StreamLimits("x", 1 << 32)
    with pytest.raises(LocalProtocolError, match="no codec"):
        StreamLimits("x", 4096, 1)
    with pytest.raises(LocalProtocolError):
        StreamLimits("x", 4096, framed=False, max_tensor_bytes=1, codecs=frozenset({"raw"}))


@pytest.mark.parametrize("doc", ["docs/wire.md", "docs/robustness.md"])
def test_the_docs_list_every_limit_as_declared(doc: str) -> None:
    assert limits.markdown_table() in (REPO / doc).read_text()


def test_a_crc_mismatch_in_a_grown_buffer_is_still_caught() -> None:
    payload = bytes(4096)
    header = make_tensor_header("w", "uint8", [4096], "raw", payload)
    bad = replace(header, crc32=zlib.crc32(payload) ^ 1)
    decoder = FrameDecoder()
    for part in encode_tensor_frame(bad, payload):
        decoder.feed(part)
    with pytest.raises(RemoteProtocolError, match="does not match"):
        decoder.next_event()
