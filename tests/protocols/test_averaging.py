"""`/peertrain/avg/1.0.0`, bytes only: two Exchange objects joined by an in-memory link."""

from __future__ import annotations

import itertools
import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import averaging as av
from protocols import codecs
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.wire import (
    NEED_DATA,
    Envelope,
    encode_envelope,
    encode_tensor_frame,
    make_tensor_header,
)
from tests.conftest import feed_in_place

RUN = "QmRun"
S = av.State


def join(chunks) -> bytes:
    """A gather list (or one message) as the bytes it puts on the stream."""
    if isinstance(chunks, bytes | bytearray | memoryview):
        return bytes(chunks)
    return b"".join(bytes(memoryview(c).cast("B")) for c in chunks)


def feed(ex: av.Exchange, data, cuts: list[int] = ()) -> list:
    """Deliver `data` cut at `cuts` (offsets), collecting every event until NEED_DATA."""
    data = join(data)
    events = []
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    for start, end in itertools.pairwise(bounds):
        ex.receive_data(data[start:end])
        while (event := ex.next_event()) is not NEED_DATA:
            events.append(event)
    return events


def pair(numel=100, codecs_=("fp32",), chunk=40, r=3, responder_codecs=codecs.CODECS, **kw):
    a = av.Exchange("initiator", RUN, r, numel, list(codecs_), chunk_elems=chunk, **kw)
    b = av.Exchange("responder", RUN, None, None, list(responder_codecs))
    return a, b


def agreed(numel=100, codec="fp32", chunk=40):
    """A pair in SWAPPING, `codec` agreed."""
    a, b = pair(numel, [codec], chunk)
    feed(b, a.initiate())
    feed(a, b.accept(codec))
    return a, b


def expected_after(vec: torch.Tensor, codec: str, chunk: int) -> torch.Tensor:
    """What the receiver must end up with: each chunk through the codec on its own."""
    parts = [
        codecs.decode(codec, e.dtype, e.shape, e.payload, e.shape[0])
        for e in (codecs.encode(c.contiguous(), codec) for c in vec.split(chunk))
    ]
    return torch.cat(parts)


def frame(name: str, values: torch.Tensor, codec: str = "fp32", r: int = 3) -> list:
    enc = codecs.encode(values, codec)
    header = make_tensor_header(name, enc.dtype, enc.shape, codec, enc.payload)
    return encode_tensor_frame(header, enc.payload, id=r)


def message(type_: str, body, r: int = 3) -> bytes:
    return encode_envelope(Envelope(type_, r, body))


def refuses(ex: av.Exchange, data, match: str, cuts: list[int] = ()) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        feed(ex, data, cuts)
    assert ex.state is S.DEAD
    with pytest.raises(RemoteProtocolError, match="already failed"):
        ex.next_event()
    with pytest.raises(RemoteProtocolError):
        ex.receive_data(b"more")


# --- whole exchanges --------------------------------------------------------------------


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_every_codec_swaps_the_vectors(codec):
    numel, chunk = 10_000, 4096 + 7  # a ragged last frame, int8 chunks across frames
    a_vec, b_vec = torch.randn(numel) * 0.02, torch.randn(numel) * 0.02
    a, b = pair(numel, [codec, "bf16"], chunk)
    offer = feed(b, a.initiate())
    assert offer == [av.OfferReceived(3, numel, (codec, "bf16"), chunk, ())]
    assert b.state is S.DECIDING
    assert feed(a, b.accept(av.negotiate(offer[0].codecs, codecs.CODECS))) == [av.Accepted(codec)]
    to_b, to_a = a.send_vector(a_vec), b.send_vector(b_vec)
    got_b, got_a = feed(b, to_b), feed(a, to_a)
    for events, vec, ex in ((got_b, a_vec, b), (got_a, b_vec, a)):
        assert [type(e) for e in events] == [av.ChunkReceived] * 3 + [av.PeerDone]
        assert [e.index for e in events[:3]] == [0, 1, 2] and events[-1] == av.PeerDone(3)
        want = expected_after(vec, codec, chunk)
        assert torch.equal(ex.received_vector(), want)
        assert torch.equal(events[1].tensor, want[chunk : 2 * chunk])
        assert ex.state is S.DONE
        tolerance = {"float32": 0, "bfloat16": 4e-3, "int8": 2e-2}[codecs.dtype_of(codec)]
        assert float((want - vec).norm() / vec.norm()) <= tolerance


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(codecs.CODECS),
    st.integers(1, 3000),
    st.integers(1, 1200),
    st.lists(st.integers(0, 20_000), max_size=8),
)
def test_any_split_of_the_byte_streams_gives_the_same_result(codec, numel, chunk, cuts):
    a_vec, b_vec = torch.randn(numel), torch.randn(numel)
    a, b = pair(numel, [codec], chunk)
    feed(b, a.initiate(), cuts)
    feed(a, b.accept(codec), cuts)
    feed(b, a.send_vector(a_vec), cuts)
    feed(a, b.send_vector(b_vec), cuts)
    assert a.state is b.state is S.DONE
    assert torch.equal(b.received_vector(), expected_after(a_vec, codec, chunk))
    assert torch.equal(a.received_vector(), expected_after(b_vec, codec, chunk))


def test_the_fallback_is_accepted_even_when_not_offered():
    a, b = pair(codecs_=["int8"], responder_codecs=["bf16"])
    offer = feed(b, a.initiate())[0]
    codec = av.negotiate(offer.codecs, b.codecs)
    assert codec == "fp32"
    assert feed(a, b.accept(codec)) == [av.Accepted("fp32")]


def test_a_reject_reaches_the_initiator_and_closes_both():
    a, b = pair()
    feed(b, a.initiate())
    assert feed(a, b.reject("not my partner in round 3" + "!" * 500)) == [
        av.Rejected("not my partner in round 3" + "!" * (av.MAX_REASON - 25))
    ]
    assert a.state is b.state is S.CLOSED
    # a tensor frame is refused on its header: no tensor is expected, none is buffered
    refuses(a, frame("theta/0", torch.zeros(40)), "max_tensor_bytes=0")


def test_a_lane_is_offered_and_chosen():
    a, b = pair(lanes=[av.LANE_TCP])
    offer = feed(b, a.initiate())[0]
    assert offer.lanes == (av.LANE_TCP,)
    lane = av.Lane(av.LANE_TCP, 4242, b"k" * 32)
    assert feed(a, b.accept("fp32", lane)) == [av.Accepted("fp32", lane)]
    a, b = pair()  # not offered: neither side may pick it
    feed(b, a.initiate())
    with pytest.raises(LocalProtocolError, match="not offered"):
        b.accept("fp32", lane)
    bad = message("avg.accept", {"round": 3, "codec": "fp32", "lane": {"kind": av.LANE_TCP}})
    refuses(a, bad, "did not offer")


def feed_lane(ex: av.Exchange, data, cuts: list[int] = ()) -> list:
    """As `feed`, but as the lane's reader: bytes go where receive_buffer() says if it can."""
    data = join(data)
    events = []
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    for start, end in itertools.pairwise(bounds):
        events += feed_in_place(ex, ex.receive_data, memoryview(data)[start:end])
    return events


def tensor_headers(chunks) -> list[dict]:
    """The tensor headers in a gather list, as the peer's msgpack decoder sees them."""
    return [
        msgpack.unpackb(c[4:])["b"]
        for c in chunks
        if isinstance(c, bytes) and msgpack.unpackb(c[4:])["t"] == "tensor"
    ]


def lane_pair(numel=100, codec="fp32", chunk=40):
    """A pair in SWAPPING that agreed on a lane."""
    a, b = pair(numel, [codec], chunk, lanes=[av.LANE_TCP])
    feed(b, a.initiate())
    feed(a, b.accept(codec, av.Lane(av.LANE_TCP, 4242, b"k" * 32)))
    return a, b


def test_on_a_lane_tensor_headers_carry_no_crc32():
    """GCM authenticates every lane record; the crc32 stays on the libp2p stream."""
    vec = torch.randn(100)
    a, b = lane_pair()
    frames = a.send_vector(vec)
    assert [sorted(h) for h in tensor_headers(frames)] == [
        ["codec", "dtype", "length", "name", "shape"]
    ] * 3
    feed(b, frames)
    assert torch.equal(b.received_vector(), vec)
    a, b = agreed()  # no lane: every header has its crc32, and one without is refused
    assert all("crc32" in h for h in tensor_headers(a.send_vector(vec)))
    _, lane_b = lane_pair()
    _, b = agreed()
    refuses(b, lane_b.send_vector(vec), "exactly the keys")


@pytest.mark.parametrize("codec", codecs.CODECS)
@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 1200), st.lists(st.integers(0, 20_000), max_size=8))
def test_receiving_in_place_on_a_lane_gives_the_same_result(codec, numel, chunk, cuts):
    a_vec, b_vec = torch.randn(numel), torch.randn(numel)
    a, b = lane_pair(numel, codec, chunk)
    events = feed_lane(b, a.send_vector(a_vec), cuts)
    feed_lane(a, b.send_vector(b_vec), cuts)
    assert a.state is b.state is S.DONE
    assert isinstance(events[-1], av.PeerDone)
    assert torch.equal(b.received_vector(), expected_after(a_vec, codec, chunk))
    assert torch.equal(a.received_vector(), expected_after(b_vec, codec, chunk))


def test_fp32_payloads_are_received_straight_into_the_vector():
    a, b = lane_pair(numel=100, chunk=40)  # no crc32: the test may write what it likes
    data = join(a.send_vector(torch.ones(100)))
    first_payload = data.index(struct.pack("<f", 1.0) * 40)
    feed(b, data[:first_payload])  # theta/0's header: its payload goes into the vector
    buffer = b.receive_buffer()
    assert len(buffer) == 160
    buffer[:] = struct.pack("<f", 2.0) * 40
    b.received_into(160)
    [chunk] = [e for e in iter(b.next_event, NEED_DATA)]
    assert torch.equal(chunk.tensor, torch.full((40,), 2.0))
    buffer[:4] = struct.pack("<f", 3.0)  # the same memory as the received vector's
    assert chunk.tensor[0] == 3.0
    feed(b, data[first_payload + 160 :])
    assert b.received_vector()[0] == 3.0 and b.state is S.DONE


def test_a_bad_frame_is_refused_on_its_header_before_its_payload():
    vec = torch.randn(100)
    for bad, match in (
        (frame("theta/1", vec[40:80]), "out of order: expected 'theta/0'"),
        (frame("theta/0", vec[:39]), r"theta/0: expected shape \[40\]"),
    ):
        _, b = agreed()
        refuses(b, join(bad)[:-100], match)  # the header, and only part of the payload


def test_a_truncated_stream_waits_for_more():
    a, b = agreed(numel=100, chunk=40)
    data = join(a.send_vector(torch.ones(100)))
    for cut in range(len(data)):  # every prefix: events so far, then NEED_DATA, no error
        _a, b = agreed(numel=100, chunk=40)
        feed(b, data[:cut])
        assert b.state is S.SWAPPING and b.next_event() is NEED_DATA
    with pytest.raises(LocalProtocolError, match="not complete"):
        b.received_vector()


# --- the peer breaks the protocol -------------------------------------------------------


def test_offers_that_do_not_fit_are_refused():
    def responder(**kw):
        return av.Exchange("responder", RUN, kw.pop("r", None), kw.pop("n", None), ["fp32"], **kw)

    def offer(**over):
        body = {"run": RUN, "round": 3, "numel": 100, "codecs": ["fp32"], "chunk": 40}
        return message("avg.offer", {**body, **over})

    refuses(responder(), offer(run="QmOther"), "another run")
    refuses(responder(r=4), offer(), "offer for round 3; this exchange is round 4")
    refuses(responder(n=101), offer(), "offer of 100 values; our vector has 101")
    refuses(responder(max_numel=99), offer(), "limit 99")
    refuses(responder(max_frames=2), offer(), r"3 frames \(limit 2\)")
    refuses(responder(), offer(round=-1), "valid round")
    refuses(responder(), offer(numel=0), "values")
    refuses(responder(), offer(chunk=0), "chunks of 0")
    refuses(responder(), offer(chunk=av.MAX_CHUNK_ELEMS + 1), "chunks of")
    refuses(responder(), offer(codecs="fp32"), "codecs")
    refuses(responder(), offer(codecs=["x"] * 17), "codecs")
    refuses(responder(), offer(lanes=[1]), "lanes")
    refuses(responder(), message("avg.offer", [1, 2]), "body must be a map")
    ok = responder(r=3, n=100)
    assert feed(ok, offer(codecs=["zfp9", "bf16"])) == [
        av.OfferReceived(3, 100, ("zfp9", "bf16"), 40)
    ]


def test_answers_that_do_not_fit_are_refused():
    def offered():
        a, _ = pair(codecs_=["bf16"])
        a.initiate()
        return a

    refuses(offered(), message("avg.accept", {"round": 4, "codec": "bf16"}), "round 4")
    refuses(offered(), message("avg.accept", {"round": 3, "codec": "int8"}), "codec 'int8'")
    refuses(offered(), message("avg.accept", {"round": 3, "codec": "zfp9"}), "codec 'zfp9'")
    refuses(offered(), message("avg.reject", {"round": 3, "reason": 7}), "reason")
    refuses(offered(), message("avg.reject", {"round": 2, "reason": "x"}), "round 2")
    refuses(offered(), message("avg.offer", {}), "unexpected message 'avg.offer'")
    refuses(offered(), message("avg.hello", {}), "unexpected message 'avg.hello'")


def test_frames_must_come_in_order_in_the_agreed_codec_and_size():
    vec = torch.randn(100)
    _, b = agreed()
    refuses(b, frame("theta/1", vec[40:80]), "out of order: expected 'theta/0'")
    _, b = agreed()
    refuses(b, frame("theta/0", vec[:39]), r"expected shape \[40\]")
    _, b = agreed()
    refuses(b, frame("theta/0", vec[:40], "bf16"), "codec 'bf16' not accepted")
    _, b = agreed()  # a frame too big for one chunk is refused on its header alone
    refuses(b, join(frame("theta/0", torch.randn(1000)))[:200], "exceeds max_tensor_bytes")
    a, b = agreed()
    frames = a.send_vector(vec)
    data = join(frames[:-1]) + join(frame("theta/3", vec[:20])) + join(frames[-1])
    refuses(b, data, "too many frames")
    _, b = agreed()
    refuses(
        b,
        join(frame("theta/0", vec[:40])) + message("avg.done", {"round": 3, "frames": 1}),
        r"1 arrived \(40 of 100 values\)",
    )
    a, b = agreed()
    frames = a.send_vector(vec)
    refuses(b, join(frames[:-1]) + message("avg.done", {"round": 3, "frames": 2}), "says 2")
    a, b = agreed()
    frames = a.send_vector(vec)
    refuses(b, join(frames[:-1]) + message("avg.done", {"round": 9, "frames": 3}), "round 9")


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_nan_or_inf_weights_are_refused(codec):
    a, b = agreed(codec=codec)
    vec = torch.zeros(100)
    vec[42] = float("nan") if codec != "int8" else float("inf")
    refuses(b, a.send_vector(vec), "theta/1: received .* contains NaN/Inf")


def test_nothing_may_follow_done():
    a, b = agreed()
    vec = torch.randn(100)
    frames = a.send_vector(vec)
    assert feed(b, frames)[-1] == av.PeerDone(3)
    refuses(b, frame("theta/3", vec[:40]), "max_tensor_bytes=0")
    a, b = agreed()
    feed(b, a.send_vector(vec))
    # even an empty one: after done no tensor frame is taken, refused on its envelope
    refuses(b, frame("theta/3", torch.empty(0)), "max_tensor_bytes=0")
    a, b = agreed()
    feed(b, a.send_vector(vec))
    refuses(b, message("avg.done", {"round": 3, "frames": 3}), "unexpected message 'avg.done'")


def test_a_tensor_frame_before_the_accept_is_refused_on_its_header():
    a, b = pair()
    feed(b, a.initiate())
    header = join(frame("theta/0", torch.randn(40)))[:-160]  # its payload not sent yet
    refuses(b, header, "carries none \\(max_tensor_bytes=0\\)")


# The state machine is its table: every (role, state, cause) not in it is refused.

STATES = (S.IDLE, S.OFFERED, S.DECIDING, S.SWAPPING, S.DONE, S.CLOSED)


def in_state(role: str, state: S) -> av.Exchange | None:
    a, b = pair(numel=100, chunk=40)
    if state is S.IDLE:
        return a if role == "initiator" else b
    if (role, state) in (("initiator", S.DECIDING), ("responder", S.OFFERED)):
        return None  # not a state of that role
    feed(b, a.initiate())
    if state in (S.OFFERED, S.DECIDING):
        return a if role == "initiator" else b
    if state is S.CLOSED:
        feed(a, b.reject("no"))
        return a if role == "initiator" else b
    feed(a, b.accept("fp32"))
    if state is S.DONE:
        feed(a, b.send_vector(torch.zeros(100)))
        feed(b, a.send_vector(torch.zeros(100)))
    return a if role == "initiator" else b


PEER_MESSAGES = {
    "avg.offer": message(
        "avg.offer", {"run": RUN, "round": 3, "numel": 100, "codecs": ["fp32"], "chunk": 40}
    ),
    "avg.accept": message("avg.accept", {"round": 3, "codec": "fp32"}),
    "avg.reject": message("avg.reject", {"round": 3, "reason": "no"}),
    "tensor": join(frame("theta/0", torch.zeros(40))),
    "avg.done": message("avg.done", {"round": 3, "frames": 0}),
}


@pytest.mark.parametrize("role", ["initiator", "responder"])
@pytest.mark.parametrize("state", STATES)
def test_every_transition_missing_from_the_table_is_refused(role, state):
    assert set(av.PEER_CAUSES) == set(PEER_MESSAGES)
    for cause, data in PEER_MESSAGES.items():
        ex = in_state(role, state)
        if ex is None:
            continue
        assert ex.state is state
        if (role, state, cause) in av.TRANSITIONS:
            continue
        with pytest.raises(RemoteProtocolError, match=r"unexpected|max_tensor_bytes"):
            feed(ex, data)
        assert ex.state is S.DEAD
    calls = {
        "initiate()": lambda ex: ex.initiate(),
        "accept()": lambda ex: ex.accept("fp32"),
        "reject()": lambda ex: ex.reject("no"),
        "send_vector()": lambda ex: ex.send_vector(torch.zeros(100)),
    }
    assert set(calls) == set(av.LOCAL_CAUSES)
    for cause, call in calls.items():
        ex = in_state(role, state)
        if ex is None or (role, state, cause) in av.TRANSITIONS:
            continue
        with pytest.raises(LocalProtocolError, match="not allowed"):
            call(ex)
        assert ex.state is state  # our mistake does not kill the exchange


def test_our_own_mistakes_are_local_errors():
    with pytest.raises(LocalProtocolError):
        av.Exchange("initiator", RUN, None, 10, ["fp32"])
    with pytest.raises(LocalProtocolError):
        av.Exchange("initiator", RUN, 1, 10, ["zfp9"])
    with pytest.raises(LocalProtocolError):
        av.Exchange("initiator", RUN, 1, 10, ["fp32"], chunk_elems=0)
    with pytest.raises(LocalProtocolError):
        av.Exchange("initiator", RUN, 1, 10**6, ["fp32"], chunk_elems=1, max_frames=1000)
    with pytest.raises(LocalProtocolError):
        av.Exchange("peer", RUN, 1, 10, ["fp32"])
    a, b = pair(codecs_=["bf16"])
    feed(b, a.initiate())
    with pytest.raises(LocalProtocolError, match="cannot accept 'int8'"):
        b.accept("int8")
    feed(a, b.accept("bf16"))
    with pytest.raises(LocalProtocolError, match="100 values"):
        a.send_vector(torch.zeros(99))
    a.send_vector(torch.zeros(10, 10))  # any shape of the right size
    with pytest.raises(LocalProtocolError, match="already"):
        a.send_vector(torch.zeros(100))
    refuses(a, b"\0\0\0\0", "empty frame")
    with pytest.raises(LocalProtocolError, match="failed exchange"):
        a.send_vector(torch.zeros(100))


# --- fuzz: h11's invariant, garbage gives events or RemoteProtocolError -----------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_random_bytes_into_a_responder(data):
    b = av.Exchange("responder", RUN, None, None, ["fp32"])
    try:
        feed(b, data)
    except RemoteProtocolError:
        assert b.state is S.DEAD


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(codecs.CODECS), st.data())
def test_fuzz_a_corrupted_exchange(codec, data):
    """A valid stream with bytes flipped, dropped or inserted: events or RemoteProtocolError."""
    a, b = pair(60, [codec], 25)
    stream = bytearray(join(a.initiate()))
    offer_end = len(stream)
    feed(b, stream)
    feed(a, b.accept(codec))
    stream += join(a.send_vector(torch.randn(60, generator=torch.Generator().manual_seed(0))))
    b = av.Exchange("responder", RUN, None, None, ["fp32"])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(stream) - 1))
        edit = data.draw(st.sampled_from(["flip", "drop", "insert"]))
        if edit == "flip":
            stream[at] ^= data.draw(st.integers(1, 255))
        elif edit == "drop":
            del stream[at]
        else:
            stream[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        events = feed(b, stream[:offer_end])
        if events and b.state is S.DECIDING:
            b.accept(codec if codec in events[0].codecs else "fp32")
        feed(b, stream[offer_end:])
    except RemoteProtocolError:
        assert b.state is S.DEAD
