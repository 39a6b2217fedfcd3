"""`/peertrain/pipe/1.0.0` (protocols/pipeline.py): bytes in, checked tensors out."""

from __future__ import annotations

import contextlib
import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols import pipeline as pipe
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.wire import (
    NEED_DATA,
    Envelope,
    encode_envelope,
    encode_tensor_frame,
    make_tensor_header,
)

RUN = "QmbJita7vMGEyqez8hwZgqt4fSbGk5bKTtbDPt9xfmR8G5"
EXPECT = pipe.Expect(run=RUN, stage=2, d_model=8, max_batch=4, max_seq=16, micro_batches=4)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def join(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


def events(data: bytes, expect: pipe.Expect = EXPECT, cut: int = 0) -> list:
    rx = pipe.PipeReceiver(expect)
    out = []
    for chunk in ((data[:cut], data[cut:]) if cut else (data,)):
        rx.receive_data(chunk)
        while (ev := rx.next_event()) is not NEED_DATA:
            out.append(ev)
    return out


def act(shape=(2, 16, 8), kind="act", stage=2, step=5, mb=1, run=RUN, fill=None) -> bytes:
    t = torch.randn(shape) if fill is None else torch.full(shape, fill)
    return join(pipe.encode(kind, run, stage, step, mb, t))


def test_round_trip_is_bf16_on_the_wire() -> None:
    t = torch.randn(3, 10, 8)
    data = join(pipe.encode("grad", RUN, 2, 9, 3, t))
    assert len(data) < t.numel() * 2 + 300  # 2 bytes a value, plus two small envelopes
    (ev,) = events(data)
    assert isinstance(ev, pipe.TensorReceived)
    assert (ev.header.kind, ev.header.step, ev.header.mb, ev.header.shape) == (
        "grad", 9, 3, (3, 10, 8))
    assert ev.tensor.dtype == torch.float32
    torch.testing.assert_close(ev.tensor, t.to(torch.bfloat16).float())


@FAST
@given(b=st.integers(1, 4), t=st.integers(1, 16), step=st.integers(0, 2**62 - 1),
       mb=st.integers(0, 3), kind=st.sampled_from(["act", "grad"]), cut=st.integers(0, 400),
       n=st.integers(1, 3))
def test_any_valid_sequence_arrives_whole_however_it_is_cut(b, t, step, mb, kind, cut, n):
    tensors = [torch.randn(b, t, 8) for _ in range(n)]
    data = b"".join(join(pipe.encode(kind, RUN, 2, step, mb, x)) for x in tensors)
    got = events(data, cut=min(cut, len(data)))
    assert len(got) == n
    for ev, x in zip(got, tensors, strict=True):
        assert ev.header.shape == (b, t, 8) and ev.header.step == step
        torch.testing.assert_close(ev.tensor, x.to(torch.bfloat16).float())


@FAST
@given(data=st.binary(max_size=300), prefix=st.integers(0, 2))
def test_garbage_yields_events_or_remote_protocol_error(data: bytes, prefix: int) -> None:
    stream = act()[: prefix * 40] + data
    with contextlib.suppress(RemoteProtocolError):
        events(stream)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"stage": 3}, "act for stage 3 sent to stage 2"),
    ({"run": "QmOther"}, "is not this stream's run"),
    ({"mb": 4}, "micro-batch 4 >= the run's 4 per step"),
    ({"shape": (2, 16, 9)}, "d_model 9 is not the model's 8"),
    ({"shape": (5, 16, 8)}, "batch must be 1..4"),
    ({"shape": (2, 17, 8)}, "sequence 1..16"),
])
def test_wrong_shape_stage_or_run_is_refused_with_a_reason(kwargs, reason) -> None:
    with pytest.raises(RemoteProtocolError, match=reason):
        events(act(**kwargs))


def test_a_declared_huge_tensor_is_refused_before_allocation() -> None:
    # A fine envelope, then a tensor header announcing 1 GiB (and no payload at all): the
    # stream's decoder is bounded by this stage's largest micro-batch (1 KiB here).
    body = {"run": RUN, "stage": 2, "step": 0, "mb": 0, "shape": [2, 16, 8],
            "dtype": "bfloat16"}
    head = msgpack.packb({"v": 1, "t": "tensor", "id": 0, "b": {
        "name": "x", "dtype": "bfloat16", "shape": [16384, 32768], "codec": "raw",
        "length": 1 << 30, "crc32": 0}})
    rx = pipe.PipeReceiver(EXPECT)
    rx.receive_data(encode_envelope(Envelope("pipe.act", 0, body)))
    rx.receive_data(len(head).to_bytes(4, "big") + head)
    with pytest.raises(RemoteProtocolError, match="1073741824"):
        rx.next_event()
    assert rx.state is pipe.State.DEAD
    with pytest.raises(RemoteProtocolError, match="dead"):
        rx.receive_data(b"x")


def test_tensor_frame_must_match_its_envelope() -> None:
    body = {"run": RUN, "stage": 2, "step": 0, "mb": 0, "shape": [2, 16, 8],
            "dtype": "bfloat16"}
    env = encode_envelope(Envelope("pipe.act", 0, body))
    other = torch.zeros(2, 8, 8, dtype=torch.bfloat16)
    from protocols.wire import tensor_payload

    dtype, shape, view = tensor_payload(other)
    frame = join(encode_tensor_frame(make_tensor_header("x", dtype, shape, "raw", view), view))
    with pytest.raises(RemoteProtocolError, match="not the announced"):
        events(env + frame)
    f32 = torch.zeros(2, 16, 8)
    dtype, shape, view = tensor_payload(f32)
    frame = join(encode_tensor_frame(make_tensor_header("x", dtype, shape, "raw", view), view))
    with pytest.raises(RemoteProtocolError):  # float32: over the bound, or the wrong dtype
        events(env + frame)
    with pytest.raises(RemoteProtocolError, match="without"):
        events(frame)


def test_the_visit_travels_with_a_message_and_defaults_to_the_stage() -> None:
    """CheckFree+ visits an edge stage twice: `hop` says which visit a tensor is for."""
    t = torch.randn(2, 16, 8)
    (ev,) = events(join(pipe.encode("act", RUN, 2, 5, 1, t, hop=4)))
    assert (ev.header.stage, ev.header.hop) == (2, 4)
    (ev,) = events(join(pipe.encode("act", RUN, 2, 5, 1, t)))
    assert ev.header.hop == 2  # no hop on the wire: stage order
    for hop in (-1, pipe.MAX_HOPS, "4", 1.5):
        body = {"run": RUN, "stage": 2, "step": 0, "mb": 0, "shape": [2, 16, 8],
                "dtype": "bfloat16", "hop": hop}
        with pytest.raises(RemoteProtocolError, match="hop must be an int"):
            events(encode_envelope(Envelope("pipe.act", 0, body)))


def test_the_origin_travels_with_a_message_size_checked_and_defaults_to_none() -> None:
    """Two first-stage replicas cut micro-batch k of a step each: `origin` tells them apart
    (docs/pipeline.md); a sender that writes none sends the bytes it sent before."""
    t = torch.randn(2, 16, 8)
    (ev,) = events(join(pipe.encode("act", RUN, 2, 5, 1, t, origin="12D3KooWA")))
    assert (ev.header.origin, ev.header.mb) == ("12D3KooWA", 1)
    assert join(pipe.encode("act", RUN, 2, 5, 1, t, origin="")) == join(
        pipe.encode("act", RUN, 2, 5, 1, t))
    (ev,) = events(join(pipe.encode("act", RUN, 2, 5, 1, t)))
    assert ev.header.origin == ""
    for origin in ("", "x" * (pipe.ORIGIN_MAX + 1), 7, b"peer", None):
        body = {"run": RUN, "stage": 2, "step": 0, "mb": 0, "shape": [2, 16, 8],
                "dtype": "bfloat16", "origin": origin}
        with pytest.raises(RemoteProtocolError, match="origin must be a peer id"):
            events(encode_envelope(Envelope("pipe.act", 0, body)))


def test_announced_dtype_other_than_bf16_is_refused() -> None:
    body = {"run": RUN, "stage": 2, "step": 0, "mb": 0, "shape": [2, 16, 8],
            "dtype": "float32"}
    with pytest.raises(RemoteProtocolError, match="the wire carries bfloat16"):
        events(encode_envelope(Envelope("pipe.act", 0, body)))


def test_nan_costs_that_micro_batch_and_the_stream_goes_on() -> None:
    data = act(fill=math.nan, mb=0) + act(mb=1) + act(fill=math.inf, mb=2)
    evs = events(data)
    assert [type(e).__name__ for e in evs] == ["Refused", "TensorReceived", "Refused"]
    assert "NaN or inf" in evs[0].reason and evs[0].header.mb == 0


def test_a_stage_that_takes_only_activations_refuses_gradients() -> None:
    only = pipe.Expect(RUN, 2, 8, 4, 16, 4, kinds=frozenset({"act"}))
    with pytest.raises(RemoteProtocolError, match=r"accepts no pipe\.grad"):
        events(act(kind="grad"), only)


def test_local_misuse_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError, match="batch, seq, d_model"):
        pipe.encode("act", RUN, 0, 0, 0, torch.zeros(4, 4))
    with pytest.raises(LocalProtocolError, match="kind"):
        pipe.encode("weights", RUN, 0, 0, 0, torch.zeros(1, 1, 1))  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="stage"):
        pipe.encode("act", RUN, -1, 0, 0, torch.zeros(1, 1, 1))
    with pytest.raises(LocalProtocolError, match="over the format"):
        pipe.Expect(RUN, 0, 16384, 64, 65536, 4)


def test_the_receivers_bound_is_its_own_largest_micro_batch() -> None:
    assert EXPECT.limits().max_tensor_bytes == 4 * 16 * 8 * 2
    assert pipe.LIMITS.protocol == pipe.PROTOCOL_ID == "/peertrain/pipe/1.0.0"


# -- the kinds a live pipeline adds: targets, the tied head's gradient and matrix ---------

TAIL = pipe.Expect(RUN, 3, 8, 4, 16, 4, kinds=frozenset({"act", "tgt", "tied"}), vocab=32)


def test_targets_travel_as_int64_and_must_be_in_the_vocabulary() -> None:
    y = torch.randint(0, 32, (2, 16))
    (ev,) = events(join(pipe.encode("tgt", RUN, 3, 4, 1, y)), TAIL)
    assert isinstance(ev, pipe.TensorReceived) and ev.tensor.dtype == torch.int64
    assert torch.equal(ev.tensor, y)
    bad = y.clone()
    bad[0, 0] = 32
    rx = pipe.PipeReceiver(TAIL)
    rx.receive_data(join(pipe.encode("tgt", RUN, 3, 4, 2, bad)) + join(pipe.encode(
        "tgt", RUN, 3, 4, 3, y)))
    first, second = rx.next_event(), rx.next_event()
    assert isinstance(first, pipe.Refused) and "vocabulary" in first.reason
    assert isinstance(second, pipe.TensorReceived)  # the stream goes on


def test_the_tied_matrix_must_have_the_model_s_shape() -> None:
    w = torch.randn(32, 8)
    (ev,) = events(join(pipe.encode("tied", RUN, 3, 7, 0, w)), TAIL)
    assert isinstance(ev, pipe.TensorReceived) and ev.tensor.shape == (32, 8)
    with pytest.raises(RemoteProtocolError, match="tied matrix"):
        events(join(pipe.encode("tied", RUN, 3, 7, 0, torch.randn(31, 8))), TAIL)
    with pytest.raises(RemoteProtocolError, match=r"accepts no pipe\.tgrad"):
        events(join(pipe.encode("tgrad", RUN, 3, 7, 0, w)), TAIL)


def test_a_receiver_s_tensor_bound_covers_the_tied_matrix() -> None:
    assert TAIL.max_bytes == max(4 * 16 * 8 * 2, 32 * 8 * 2, 4 * 16 * 8)
    head_only = pipe.Expect(RUN, 0, 8, 1, 1, 4, kinds=frozenset({"tgrad"}), vocab=256)
    assert head_only.max_bytes == 256 * 8 * 2


def test_a_stream_that_ends_between_messages_ended_cleanly() -> None:
    rx = pipe.PipeReceiver(EXPECT)
    assert rx.between_messages
    data = act()
    rx.receive_data(data[:10])
    assert rx.next_event() is NEED_DATA and not rx.between_messages
    rx.receive_data(data[10:])
    assert isinstance(rx.next_event(), pipe.TensorReceived) and rx.between_messages


# -- /peertrain/pipe-weights/1.0.0 ----------------------------------------------------------

SHAPES = {"0.w": (4, 8), "0.b": (8,)}


def weights_events(parts: list, shapes=SHAPES, stage: int = 1) -> list:
    rx = pipe.WeightsReceiver(RUN, stage, shapes)
    rx.receive_data(join(parts))
    out = []
    while (ev := rx.next_event()) is not NEED_DATA:
        out.append(ev)
    return out


def test_a_stage_s_weights_arrive_whole_and_exact() -> None:
    state = {"0.w": torch.randn(4, 8), "0.b": torch.randn(8)}
    (ev,) = weights_events(pipe.encode_weights(RUN, 1, 42, 0.5, state))
    assert isinstance(ev, pipe.WeightsReceived) and (ev.step, ev.gnorm) == (42, 0.5)
    assert ev.trained is None  # an older host's answer: no claim of trained steps
    (ev,) = weights_events(pipe.encode_weights(RUN, 1, 42, 0.5, state, trained=7))
    assert (ev.step, ev.trained) == (42, 7)
    assert all(torch.equal(ev.tensors[k], state[k]) for k in state)
    (none,) = weights_events([pipe.encode_no_weights("not training yet")])
    assert isinstance(none, pipe.NoWeights) and none.reason == "not training yet"


@pytest.mark.parametrize(("state", "stage", "match"), [
    ({"0.w": torch.randn(4, 8)}, 1, "other tensors"),  # a tensor missing
    ({"0.w": torch.randn(4, 9), "0.b": torch.randn(8)}, 1, "shape"),  # a wrong shape
    ({"0.w": torch.full((4, 8), float("nan")), "0.b": torch.randn(8)}, 1, "NaN"),
    ({"0.w": torch.randn(4, 8), "0.b": torch.randn(8)}, 2, "asked"),  # another stage's
])
def test_weights_that_are_not_the_stage_s_are_refused(state, stage, match) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        weights_events(pipe.encode_weights(RUN, stage, 1, 0.5, state))


def test_a_weights_request_is_checked() -> None:
    dec = pipe.WEIGHTS_REQUEST_LIMITS.decoder()
    dec.feed(pipe.encode_weights_request(RUN, 3, "blocks"))
    assert pipe.check_weights_request(dec.next_event(), RUN) == (3, "blocks")
    dec = pipe.WEIGHTS_REQUEST_LIMITS.decoder()
    dec.feed(pipe.encode_weights_request(RUN, 0, "ends"))  # CheckFree+: an edge's ends
    assert pipe.check_weights_request(dec.next_event(), RUN) == (0, "ends")
    bad = encode_envelope(Envelope("pipe.wget", 0, {"run": RUN, "stage": 3, "part": "optim"}))
    dec = pipe.WEIGHTS_REQUEST_LIMITS.decoder()
    dec.feed(bad)
    with pytest.raises(RemoteProtocolError, match="part"):
        pipe.check_weights_request(dec.next_event(), RUN)


def test_a_lane_reply_is_an_offer_a_reason_or_refused() -> None:
    def reply(data: bytes):
        decoder = pipe.LANE_REPLY_LIMITS.decoder()
        decoder.feed(data)
        return pipe.parse_lane_reply(decoder.next_event())

    assert reply(pipe.encode_lane_offer(4242, b"k" * 32)) == (4242, b"k" * 32)
    assert reply(pipe.encode_no_lane("busy")) == "busy"
    for bad in (pipe.encode_lane_offer(0, b"k" * 32), pipe.encode_lane_offer(80, b"short"),
                encode_envelope(Envelope("pipe.act", 0, {}))):
        with pytest.raises(RemoteProtocolError, match="expected a lane offer"):
            reply(bad)
    (asked,) = events(pipe.encode_lane_request(RUN))
    assert isinstance(asked, pipe.LaneAsked)
