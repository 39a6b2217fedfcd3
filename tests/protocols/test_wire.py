"""protocols/wire.py, bytes only: encoders on one side, a FrameDecoder fed in arbitrary
splits on the other.

The fuzz properties at the end hold h11's invariant: whatever bytes arrive, in whatever
splits, the decoder yields Envelopes, TensorFrames, NEED_DATA or RemoteProtocolError,
and nothing else.
"""

from __future__ import annotations

import itertools
import struct
import tracemalloc
import zlib
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.wire import (
    DTYPES,
    NEED_DATA,
    WIRE_VERSION,
    DecoderStatistics,
    Envelope,
    FrameDecoder,
    TensorFrame,
    TensorHeader,
    encode_envelope,
    encode_tensor_frame,
    make_tensor_header,
    tensor_from_payload,
    tensor_payload,
)
from tests.conftest import feed_in_place

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}


# --- helpers: the two ends of a fake link ------------------------------------------------


def frame_of(obj: Any) -> bytes:
    """A frame around any msgpack value, valid or not as an envelope."""
    packed = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(packed)) + packed


def tensor_frame_of(header_body: Any, payload: bytes = b"", id: int = 0) -> bytes:
    return frame_of({"v": 1, "t": "tensor", "id": id, "b": header_body}) + payload


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` split at the given offsets (clamped, sorted, duplicates give empty chunks)."""
    points = sorted(min(max(c, 0), len(data)) for c in cuts)
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def drain(decoder: FrameDecoder, chunks: list[bytes]) -> list[Envelope | TensorFrame]:
    """Feed `chunks` one by one, collecting every event, as a node's stream pump does."""
    events: list[Envelope | TensorFrame] = []
    for chunk in chunks:
        decoder.feed(chunk)
        while (event := decoder.next_event()) is not NEED_DATA:
            events.append(event)
    return events


def drain_untrusted(decoder: FrameDecoder, chunks: list[bytes]) -> None:
    """h11's invariant: events, NEED_DATA or RemoteProtocolError; anything else fails."""
    try:
        for event in drain(decoder, chunks):
            assert isinstance(event, Envelope | TensorFrame)
    except RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):  # and the decoder stays dead
            decoder.next_event()
        with pytest.raises(RemoteProtocolError):
            decoder.feed(b"\x00")


def wire_of_tensor(t: torch.Tensor, name: str = "w", id: int = 0) -> bytes:
    dtype, shape, view = tensor_payload(t)
    header = make_tensor_header(name, dtype, shape, "raw", view)
    return b"".join(bytes(part) for part in encode_tensor_frame(header, view, id=id))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(tensor_payload(a)[2]) == bytes(tensor_payload(b)[2])
    )


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.startswith(("float", "bfloat")):
        return torch.randn(shape, generator=g).to(TORCH_DTYPES[dtype])
    return torch.randint(-100, 100, shape, generator=g).to(TORCH_DTYPES[dtype])


# --- strategies --------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=16)
    | st.binary(max_size=16)
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=16,
)
envelopes = st.builds(
    Envelope,
    type=st.text(min_size=1, max_size=64).filter(lambda t: t != "tensor"),
    id=st.integers(0, 2**63 - 1),
    body=msgpack_values,
)
shapes = st.lists(st.integers(0, 5), max_size=4).map(tuple)
cuts = st.lists(st.integers(0, 1 << 16), max_size=12)


# --- round trips -------------------------------------------------------------------------


@FAST
@given(envs=st.lists(envelopes, min_size=1, max_size=5), cuts=cuts)
def test_envelopes_round_trip_in_any_split(envs: list[Envelope], cuts: list[int]) -> None:
    wire = b"".join(encode_envelope(env) for env in envs)
    decoder = FrameDecoder()
    assert drain(decoder, cut(wire, cuts)) == envs
    assert decoder.next_event() is NEED_DATA
    assert decoder.statistics() == DecoderStatistics(frames=len(envs), bytes_in=len(wire))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@FAST
@given(shape=shapes, seed=st.integers(0, 2**16), id=st.integers(0, 2**63 - 1), data=st.data())
def test_tensor_frames_round_trip_every_dtype(
    dtype: str, shape: tuple[int, ...], seed: int, id: int, data: st.DataObject
) -> None:
    t = make_tensor(dtype, shape, seed)
    wire = wire_of_tensor(t, name="layer.0.weight", id=id)
    chunks = cut(wire, data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    [frame] = drain(FrameDecoder(), chunks)
    assert isinstance(frame, TensorFrame)
    assert frame.id == id
    assert frame.header.name == "layer.0.weight"
    assert frame.header.dtype == dtype
    assert frame.header.shape == shape
    assert same_bits(tensor_from_payload(frame.header, frame.payload), t)


def mixed_wire(items: list[Any]) -> bytes:
    """Envelopes and tensors (dtype, shape), encoded one after the other."""
    wire = bytearray()
    for i, item in enumerate(items):
        if isinstance(item, Envelope):
            wire += encode_envelope(item)
        else:
            wire += wire_of_tensor(make_tensor(*item, seed=i), name=f"t{i}")
    return bytes(wire)


@FAST
@given(
    items=st.lists(st.one_of(envelopes, st.tuples(st.sampled_from(sorted(DTYPES)), shapes))),
    data=st.data(),
)
def test_mixed_stream_round_trips(items: list[Any], data: st.DataObject) -> None:
    wire = mixed_wire(items)
    chunks = cut(wire, data.draw(st.lists(st.integers(0, len(wire)), max_size=16)))
    events = drain(FrameDecoder(), chunks)
    assert len(events) == len(items)
    for i, (item, event) in enumerate(zip(items, events, strict=True)):
        if isinstance(item, Envelope):
            assert event == item
        else:
            assert isinstance(event, TensorFrame)
            expected = make_tensor(*item, seed=i)
            assert same_bits(tensor_from_payload(event.header, event.payload), expected)


def test_payload_may_exceed_max_frame_bytes() -> None:
    """max_frame_bytes bounds the envelope; the payload answers to max_tensor_bytes."""
    t = torch.arange(4096, dtype=torch.float32)
    [frame] = drain(FrameDecoder(max_frame_bytes=256), [wire_of_tensor(t)])
    assert torch.equal(tensor_from_payload(frame.header, frame.payload), t)


def test_scalar_and_empty_tensors() -> None:
    for t in (torch.tensor(2.5), torch.zeros(0, 3), torch.zeros(3, 0, dtype=torch.bfloat16)):
        [frame] = drain(FrameDecoder(), [wire_of_tensor(t)])
        assert same_bits(tensor_from_payload(frame.header, frame.payload), t)


def test_gather_list_views_the_tensor_memory() -> None:
    """The payload is written from the tensor itself: no copy on the send path."""
    t = torch.zeros(1024, dtype=torch.float32)
    dtype, shape, view = tensor_payload(t)
    prefix_and_envelope, payload = encode_tensor_frame(
        make_tensor_header("w", dtype, shape, "raw", view), view
    )
    assert isinstance(prefix_and_envelope, bytes)
    assert isinstance(payload, memoryview)
    t[0] = 1.0
    assert bytes(payload[:4]) == struct.pack("<f", 1.0)


def test_received_tensor_owns_its_memory() -> None:
    wire = wire_of_tensor(torch.ones(4)) * 2
    first, second = drain(FrameDecoder(), [wire])
    out = tensor_from_payload(first.header, first.payload)
    out += 1
    first.payload[:4] = b"\xff" * 4
    assert torch.equal(tensor_from_payload(second.header, second.payload), torch.ones(4))


def test_truncated_input_needs_data_not_an_error() -> None:
    envelope = encode_envelope(Envelope("ping", 1, {"n": 1}))
    wire = envelope + wire_of_tensor(torch.ones(3))
    for end in range(len(wire)):  # every proper prefix: the tensor frame never completes
        decoder = FrameDecoder()
        events = drain(decoder, [wire[:end]])
        assert len(events) == (end >= len(envelope))
        assert decoder.next_event() is NEED_DATA


# --- authenticated transports and receiving in place ------------------------------------


def test_a_crc32_may_be_left_out_only_where_the_transport_authenticates() -> None:
    t = torch.arange(8, dtype=torch.float32)
    dtype, shape, view = tensor_payload(t)
    header = make_tensor_header("w", dtype, shape, "raw", view, crc32=False)
    assert header.crc32 is None
    wire = b"".join(bytes(part) for part in encode_tensor_frame(header, view))
    assert b"crc32" not in wire
    with pytest.raises(RemoteProtocolError, match="exactly the keys"):  # the default
        drain(FrameDecoder(), [wire])
    [frame] = drain(FrameDecoder(require_crc32=False), cut(wire, [3, 40, 50]))
    assert frame.header.crc32 is None
    assert torch.equal(tensor_from_payload(frame.header, frame.payload), t)
    # Where optional, a crc32 that is present is still checked, and must be an int.
    lax = FrameDecoder(require_crc32=False)
    assert len(drain(lax, [tensor_frame_of(GOOD_HEADER, bytes(16))])) == 1
    bad = tensor_frame_of({**GOOD_HEADER, "crc32": GOOD_HEADER["crc32"] ^ 1}, bytes(16))
    with pytest.raises(RemoteProtocolError, match="does not match"):
        drain(FrameDecoder(require_crc32=False), [bad])
    with pytest.raises(RemoteProtocolError, match="crc32 must be an int"):
        drain(FrameDecoder(require_crc32=False), [tensor_frame_of({**GOOD_HEADER, "crc32": None})])


def test_payload_buffer_names_where_a_payload_is_received() -> None:
    target = bytearray(64)
    seen: list[TensorHeader] = []

    def into_target(header: TensorHeader) -> memoryview | None:
        seen.append(header)
        return memoryview(target)[8 : 8 + header.length] if header.name == "in" else None

    t = torch.arange(4, dtype=torch.float32)
    wire = wire_of_tensor(t, name="in") + wire_of_tensor(t, name="own")
    first, second = drain(FrameDecoder(payload_buffer=into_target), cut(wire, [30, 61, 62]))
    assert [h.name for h in seen] == ["in", "own"]
    assert bytes(target[8:24]) == bytes(tensor_payload(t)[2])  # landed in the caller's memory
    first.payload[:4] = b"\0\0\0\0"
    assert target[8:12] == b"\0\0\0\0"
    assert same_bits(tensor_from_payload(second.header, second.payload), t)

    def refuse(header: TensorHeader) -> None:
        raise RemoteProtocolError(f"not {header.name!r}")

    decoder = FrameDecoder(payload_buffer=refuse)
    decoder.feed(wire_of_tensor(t, name="in")[:-8])  # the header, part of the payload
    with pytest.raises(RemoteProtocolError, match="not 'in'"):
        decoder.next_event()
    with pytest.raises(RemoteProtocolError, match="already failed"):
        decoder.next_event()
    for wrong in (memoryview(bytearray(15)), memoryview(bytes(16)), bytearray(16)):
        decoder = FrameDecoder(payload_buffer=lambda _h, w=wrong: w)
        decoder.feed(wire)
        with pytest.raises(LocalProtocolError, match="payload_buffer must return"):
            decoder.next_event()


def drain_in_place(decoder: FrameDecoder, chunks: list[bytes]) -> list[Envelope | TensorFrame]:
    """As `drain`, but as a reader that fills receive_buffer() itself whenever offered."""
    return [e for chunk in chunks for e in feed_in_place(decoder, decoder.feed, chunk)]


def callers_buffer(header: TensorHeader) -> memoryview | None:
    """A payload_buffer naming a buffer of the caller's for every other tensor (by name
    length), so that both in-place and fed payloads are exercised."""
    return memoryview(bytearray(header.length)) if len(header.name) % 2 else None


@FAST
@given(
    items=st.lists(st.one_of(envelopes, st.tuples(st.sampled_from(sorted(DTYPES)), shapes))),
    data=st.data(),
)
def test_receiving_in_place_gives_the_same_events(items: list[Any], data: st.DataObject) -> None:
    wire = mixed_wire(items)
    chunks = cut(wire, data.draw(st.lists(st.integers(0, len(wire)), max_size=16)))
    decoder = FrameDecoder(payload_buffer=callers_buffer)
    assert drain_in_place(decoder, chunks) == drain(FrameDecoder(), chunks)
    assert decoder.statistics().bytes_in == len(wire)


def test_bytes_received_in_place_are_crc_checked() -> None:
    wire = bytearray(wire_of_tensor(torch.ones(4)))
    wire[-1] ^= 1
    with pytest.raises(RemoteProtocolError, match="crc32"):
        decoder = FrameDecoder(payload_buffer=lambda h: memoryview(bytearray(h.length)))
        drain_in_place(decoder, [bytes(wire[:-16]), bytes(wire[-16:])])


def test_the_decoders_own_buffer_is_never_handed_out() -> None:
    """Room for the rest of a payload would be allocated on the header's word: fed instead."""
    wire = wire_of_tensor(torch.ones(4))
    decoder = FrameDecoder()
    decoder.feed(wire[:-10])
    assert decoder.next_event() is NEED_DATA  # the payload is under way, into our buffer
    assert decoder.receive_buffer() is None
    with pytest.raises(LocalProtocolError, match="without a receive_buffer"):
        decoder.received_into(0)
    decoder.feed(wire[-10:])
    assert isinstance(decoder.next_event(), TensorFrame)


def test_received_into_misuse() -> None:
    decoder = FrameDecoder(payload_buffer=lambda h: memoryview(bytearray(h.length)))
    assert decoder.receive_buffer() is None  # no payload under way
    with pytest.raises(LocalProtocolError, match="without a receive_buffer"):
        decoder.received_into(0)
    wire = wire_of_tensor(torch.ones(4))
    decoder.feed(wire[:-10])  # buffered, not parsed yet: no payload under way
    assert decoder.receive_buffer() is None
    with pytest.raises(LocalProtocolError):
        decoder.received_into(1)
    assert decoder.next_event() is NEED_DATA  # the header, and 6 of the payload's 16 bytes
    assert len(decoder.receive_buffer()) == 10
    with pytest.raises(LocalProtocolError, match="room for 10"):
        decoder.received_into(11)
    decoder.received_into(0)  # nothing written yet: fine
    decoder.receive_buffer()[:] = wire[-10:]
    decoder.received_into(10)
    assert isinstance(decoder.next_event(), TensorFrame)


# --- refusals: the peer's bytes ----------------------------------------------------------


def test_unknown_version_is_refused_clearly() -> None:
    decoder = FrameDecoder()
    decoder.feed(frame_of({"v": 7, "t": "ping", "id": 0, "b": None}))
    with pytest.raises(
        RemoteProtocolError, match=r"unsupported wire version 7 \(this node speaks 1\)"
    ):
        decoder.next_event()


def test_version_is_checked_before_the_rest_of_the_envelope() -> None:
    decoder = FrameDecoder()
    decoder.feed(frame_of({"v": 2, "kind": "whatever"}))
    with pytest.raises(RemoteProtocolError, match="unsupported wire version 2"):
        decoder.next_event()


def test_oversized_length_prefix_raises_before_the_frame_arrives() -> None:
    decoder = FrameDecoder(max_frame_bytes=1000)
    decoder.feed(struct.pack(">I", 1000))
    assert decoder.next_event() is NEED_DATA  # exactly the limit: wait for it
    decoder = FrameDecoder(max_frame_bytes=1000)
    decoder.feed(struct.pack(">I", 1001))  # just the prefix, none of the 1001 bytes
    with pytest.raises(RemoteProtocolError, match="exceeds max_frame_bytes=1000"):
        decoder.next_event()


def test_decoder_is_dead_after_an_error() -> None:
    decoder = FrameDecoder()
    decoder.feed(struct.pack(">I", 2**32 - 1))
    with pytest.raises(RemoteProtocolError):
        decoder.next_event()
    with pytest.raises(RemoteProtocolError, match="already failed"):
        decoder.feed(encode_envelope(Envelope("ping", 1, None)))
    with pytest.raises(RemoteProtocolError, match="already failed"):
        decoder.next_event()


GOOD_HEADER = {
    "name": "w",
    "dtype": "float32",
    "shape": [2, 2],
    "codec": "raw",
    "length": 16,
    "crc32": zlib.crc32(bytes(16)),
}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"shape": [2**40, 2**40]}, "is 4835703278458516698824704 bytes, but length says 16"),
        ({"shape": [2**30, 2**30], "length": 2**62}, "exceeds max_tensor_bytes"),
        ({"codec": "zstd", "length": 2**40}, "exceeds max_tensor_bytes"),
        ({"shape": [1] * 9, "length": 4}, "at most 8"),
        ({"shape": [-1, 2]}, "ints >= 0"),
        ({"shape": [2.0, 2]}, "ints >= 0"),
        ({"shape": "2x2"}, "shape must be a list"),
        ({"dtype": "complex64"}, "dtype 'complex64' is not one of"),
        ({"dtype": 3}, "dtype 3 is not one of"),
        ({"codec": "lz4"}, "codec 'lz4' not accepted"),
        ({"codec": ""}, "codec must be a str"),
        ({"length": 15}, "but length says 15"),
        ({"length": -1}, "length must be an int >= 0"),
        ({"crc32": 2**32}, "crc32 must be an int"),
        ({"name": "x" * 257}, "name must be a str"),
        ({"extra": 1}, "exactly the keys"),
    ],
)
def test_bad_tensor_headers_are_refused_before_allocating(changes: dict, match: str) -> None:
    decoder = FrameDecoder(allowed_codecs=frozenset({"raw", "zstd"}))
    decoder.feed(tensor_frame_of({**GOOD_HEADER, **changes}))  # header only, no payload
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match=match):
            decoder.next_event()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_payload_over_a_small_limit_is_never_allocated() -> None:
    """A size the machine could allocate, refused because the limit says so."""
    decoder = FrameDecoder(max_tensor_bytes=1 << 20, allowed_codecs=frozenset({"zstd"}))
    decoder.feed(tensor_frame_of({**GOOD_HEADER, "codec": "zstd", "length": 64 << 20}))
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match="exceeds max_tensor_bytes=1048576"):
            decoder.next_event()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_tensor_header_must_be_a_map() -> None:
    decoder = FrameDecoder()
    decoder.feed(tensor_frame_of([1, 2, 3]))
    with pytest.raises(RemoteProtocolError, match="tensor header must be a map"):
        decoder.next_event()


def test_bad_crc_is_refused_once_the_payload_is_in() -> None:
    wire = tensor_frame_of({**GOOD_HEADER, "crc32": GOOD_HEADER["crc32"] ^ 1}, bytes(16))
    decoder = FrameDecoder()
    assert drain(decoder, [wire[:-1]]) == []  # incomplete: no verdict yet
    decoder.feed(wire[-1:])
    with pytest.raises(RemoteProtocolError, match="crc32"):
        decoder.next_event()


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (struct.pack(">I", 0), "empty frame"),
        (frame_of([1, "t", 0, None]), "must be a msgpack map"),
        (frame_of({"t": "ping", "id": 0, "b": None}), "no integer wire version"),
        (frame_of({"v": True, "t": "ping", "id": 0, "b": None}), "no integer wire version"),
        (frame_of({"v": 1, "t": "ping", "id": 0}), "exactly the keys"),
        (frame_of({"v": 1, "t": "ping", "id": 0, "b": 0, "x": 0}), "exactly the keys"),
        (frame_of({"v": 1, "t": "", "id": 0, "b": None}), "type must be a str"),
        (frame_of({"v": 1, "t": "x" * 65, "id": 0, "b": None}), "type must be a str"),
        (frame_of({"v": 1, "t": b"ping", "id": 0, "b": None}), "type must be a str"),
        (frame_of({"v": 1, "t": "ping", "id": -1, "b": None}), "id must be an int"),
        (frame_of({"v": 1, "t": "ping", "id": 2**63, "b": None}), "id must be an int"),
        (frame_of({"v": 1, "t": "ping", "id": False, "b": None}), "id must be an int"),
        (frame_of({"v": 1, "t": "ping", "id": 0, "b": {1: 2}}), "malformed msgpack"),
        (struct.pack(">I", 2) + b"\xc1\xc1", "malformed msgpack"),
        (struct.pack(">I", 3) + b"\x91\xc0\xc0", "malformed msgpack"),  # trailing byte
        (struct.pack(">I", 5) + b"\xdd\xff\xff\xff\xff", "malformed msgpack"),  # 4G-item array
        (struct.pack(">I", 2) + b"\xa1\xff", "malformed msgpack"),  # invalid UTF-8
        (struct.pack(">I", 2001) + b"\x91" * 2000 + b"\xc0", "malformed msgpack"),  # too deep
    ],
)
def test_malformed_envelopes_are_refused(frame: bytes, match: str) -> None:
    decoder = FrameDecoder()
    decoder.feed(frame)
    with pytest.raises(RemoteProtocolError, match=match):
        decoder.next_event()


def test_tensor_from_payload_checks_the_size() -> None:
    header = TensorHeader("w", "float32", (2, 2), "raw", 16, 0)
    assert tensor_from_payload(header, bytes(16)).shape == (2, 2)
    with pytest.raises(RemoteProtocolError, match="needs 16 bytes, payload has 12"):
        tensor_from_payload(header, bytes(12))
    with pytest.raises(RemoteProtocolError, match="not one of"):
        tensor_from_payload(TensorHeader("w", "complex64", (2,), "raw", 16, 0), bytes(16))


# --- refusals: our own misuse ------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "match"),
    [
        (Envelope("tensor", 0, {}), "use encode_tensor_frame"),
        (Envelope("", 0, {}), "type must be a str"),
        (Envelope("ping", -1, {}), "id must be an int"),
        (Envelope("ping", 0, object()), "cannot encode"),
        (Envelope("ping", 0, b"x" * (1 << 20)), "over max_frame_bytes"),
        (Envelope("ping", 0, {}, version=-1), "wire version must be an int"),
    ],
)
def test_encode_envelope_refuses_what_the_peer_would(env: Envelope, match: str) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        encode_envelope(env)


def test_encode_can_speak_another_version_for_tests_and_upgrades() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_envelope(Envelope("ping", 0, None, version=WIRE_VERSION + 1)))
    with pytest.raises(RemoteProtocolError, match="unsupported wire version 2"):
        decoder.next_event()


def test_tensor_encoding_misuse() -> None:
    with pytest.raises(LocalProtocolError, match="dtype 'complex64'"):
        make_tensor_header("w", "complex64", (2,), "raw", bytes(16))
    with pytest.raises(LocalProtocolError, match="but length says 12"):
        make_tensor_header("w", "float32", (2, 2), "raw", bytes(12))
    with pytest.raises(LocalProtocolError, match="bytes-like"):
        make_tensor_header("w", "float32", (1,), "raw", "abcd")  # type: ignore[arg-type]
    header = make_tensor_header("w", "float32", (2, 2), "raw", bytes(16))
    with pytest.raises(LocalProtocolError, match="payload is 12 bytes"):
        encode_tensor_frame(header, bytes(12))
    with pytest.raises(LocalProtocolError, match="id must be an int"):
        encode_tensor_frame(header, bytes(16), id=2**63)
    with pytest.raises(LocalProtocolError, match="contiguous"):
        tensor_payload(torch.zeros(4, 4).t())
    with pytest.raises(LocalProtocolError, match="no wire name"):
        tensor_payload(torch.zeros(2, dtype=torch.complex64))


def test_decoder_misuse() -> None:
    with pytest.raises(LocalProtocolError):
        FrameDecoder(max_frame_bytes=0)
    with pytest.raises(LocalProtocolError):
        FrameDecoder(max_frame_bytes=2**32)
    with pytest.raises(LocalProtocolError):
        FrameDecoder(max_tensor_bytes=-1)
    decoder = FrameDecoder()
    with pytest.raises(LocalProtocolError, match="bytes-like"):
        decoder.feed("ping")  # type: ignore[arg-type]
    decoder.feed(encode_envelope(Envelope("ping", 3, None)))  # misuse did not kill it
    assert decoder.next_event() == Envelope("ping", 3, None)


# --- fuzz: h11's invariant ---------------------------------------------------------------

limits = st.sampled_from([(1 << 20, 1 << 30), (64, 1 << 10), (8, 0)])


@FUZZ
@given(data=st.binary(max_size=512), cuts=st.lists(st.integers(0, 512), max_size=8), lim=limits)
def test_fuzz_arbitrary_bytes(data: bytes, cuts: list[int], lim: tuple[int, int]) -> None:
    drain_untrusted(FrameDecoder(*lim), cut(data, cuts))


@FUZZ
@given(
    body=msgpack_values,
    top=st.dictionaries(st.sampled_from(["v", "t", "id", "b", "x"]), msgpack_values, max_size=5),
    version_one=st.booleans(),
    tail=st.binary(max_size=64),
    cuts=cuts,
)
def test_fuzz_framed_msgpack(
    body: Any, top: dict, version_one: bool, tail: bytes, cuts: list[int]
) -> None:
    """Well-framed msgpack reaches the envelope checks, which random bytes rarely do."""
    if version_one:
        top["v"] = 1
    wire = frame_of(body) + frame_of(top) + tail
    drain_untrusted(FrameDecoder(), cut(wire, cuts))


anything = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.lists(st.integers(0, 3), max_size=2)  # unhashable: `x in DTYPES` would raise
    | st.dictionaries(st.text(max_size=2), st.integers(-(2**63), 2**63 - 1), max_size=2)
)
ODD_VALUES = [
    None, True, False, -1, 0, 2**64 - 1, 1.5, float("nan"), "", "x" * 300, "raw", "tensor",
    b"raw", [], [1], [2**64 - 1] * 2, [-1], ["a"], [[1]], [1] * 9, {}, {"a": 1},
]  # fmt: skip


@pytest.mark.parametrize("key", [*sorted(GOOD_HEADER), "extra"])
def test_every_header_field_with_every_odd_value(key: str) -> None:
    """The table of single-field faults, each one reaching every later check."""
    for base, value, payload in itertools.product(
        (GOOD_HEADER, {**GOOD_HEADER, "codec": "x"}),  # "x" skips the raw length check
        ODD_VALUES,
        (b"", bytes(16), bytes(40)),
    ):
        wire = tensor_frame_of({**base, key: value}, payload)
        drain_untrusted(FrameDecoder(allowed_codecs=frozenset({"raw", "x"})), [wire])


@pytest.mark.parametrize("key", ["v", "t", "id", "b", "x"])
def test_every_envelope_field_with_every_odd_value(key: str) -> None:
    for value in ODD_VALUES:
        envelope = {"v": 1, "t": "ping", "id": 0, "b": None, key: value}
        drain_untrusted(
            FrameDecoder(), [frame_of(envelope) + frame_of({**envelope, "t": "tensor"})]
        )


field_values = (
    anything
    | st.sampled_from([*sorted(DTYPES), "raw", "zstd", ""])
    | st.lists(st.integers(-1, 2**64 - 1) | st.integers(0, 4), max_size=9)
    | st.integers(0, 64)
)


@FUZZ
@given(
    # A sound header with up to two fields replaced and maybe one dropped, so that each
    # check is reached with the ones before it passing.
    replaced=st.dictionaries(st.sampled_from([*GOOD_HEADER, "extra"]), field_values, max_size=2),
    dropped=st.lists(st.sampled_from(sorted(GOOD_HEADER)), max_size=1),
    full_payload=st.booleans(),  # GOOD_HEADER's 16 zero bytes, so the crc check is reached
    tail=st.binary(max_size=24),
    cuts=cuts,
)
def test_fuzz_tensor_headers(
    replaced: dict, dropped: list[str], full_payload: bool, tail: bytes, cuts: list[int]
) -> None:
    header = {**GOOD_HEADER, **replaced}
    for key in dropped:
        del header[key]
    wire = tensor_frame_of(header, bytes(16 * full_payload) + tail)
    drain_untrusted(FrameDecoder(allowed_codecs=frozenset({"raw", "zstd"})), cut(wire, cuts))


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
    cuts=cuts,
)
def test_fuzz_mutated_valid_stream(flips: list[tuple[int, int]], cuts: list[int]) -> None:
    wire = bytearray(
        encode_envelope(Envelope("ping", 1, {"peers": ["a", "b"], "step": 7}))
        + wire_of_tensor(torch.arange(6, dtype=torch.int32).reshape(2, 3), id=2)
        + encode_envelope(Envelope("pong", 2, [1.5, None, b"\x00"]))
    )
    for offset, mask in flips:
        wire[offset % len(wire)] ^= mask
    drain_untrusted(FrameDecoder(max_frame_bytes=1 << 12), cut(bytes(wire), cuts))
