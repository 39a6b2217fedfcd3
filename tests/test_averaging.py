"""The weight-exchange protocol and its codecs, bytes only (no sockets)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import averaging as av
from protocols import codecs
from protocols.errors import RemoteProtocolError
from protocols.wire import NEED_DATA

RUN = "QmRun"


def join(chunks) -> bytes:
    return b"".join(bytes(memoryview(c).cast("B")) for c in chunks)


def drain(ex: av.Exchange, data: bytes, splits: list[int] | None = None) -> list:
    events = []
    bounds = zip([0, *(splits or [])], [*(splits or []), None], strict=True)
    pieces = [data[a:b] for a, b in bounds]
    for piece in pieces:
        ex.receive_data(piece)
        while (event := ex.next_event()) is not NEED_DATA:
            events.append(event)
    return events


def exchange(a_vec, b_vec, codec: str, chunk: int = 1000, splits=None):
    a = av.Exchange("initiator", RUN, 7, a_vec.numel(), [codec], chunk=chunk)
    b = av.Exchange("responder", RUN, None, None, list(codecs.CODECS))
    offer = drain(b, a.initiate(), splits)
    assert offer == [av.OfferReceived(7, a_vec.numel(), [codec], chunk)]
    assert drain(a, b.accept(av.negotiate(offer[0].codecs))) == [av.Accepted(codec)]
    drain(b, join(a.send_vector(a_vec)), splits)
    drain(a, join(b.send_vector(b_vec)), splits)
    assert a.state == b.state == "DONE"
    return a.received_vector(), b.received_vector()


@pytest.mark.parametrize("codec,tolerance", [("fp32", 0), ("fp32+zstd", 0), ("bf16", 4e-3),
                                             ("bf16+zstd", 4e-3), ("int8", 2e-2)])
def test_every_codec_swaps_vectors(codec, tolerance):
    a_vec, b_vec = torch.randn(2500) * 0.02, torch.randn(2500) * 0.02
    got_b, got_a = exchange(a_vec, b_vec, codec)
    for got, want in ((got_a, a_vec), (got_b, b_vec)):
        assert float((got - want).norm() / want.norm()) <= tolerance


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5000), max_size=6, unique=True).map(sorted))
def test_any_split_of_the_byte_stream_gives_the_same_result(splits):
    a_vec, b_vec = torch.randn(3000), torch.randn(3000)
    _got_b, got_a = exchange(a_vec, b_vec, "bf16+zstd", chunk=700, splits=splits)
    assert torch.allclose(got_a, a_vec.to(torch.bfloat16).float())


def responder_after_offer(numel=100, codec="fp32"):
    a = av.Exchange("initiator", RUN, 3, numel, [codec], chunk=50)
    b = av.Exchange("responder", RUN, None, None, [codec])
    drain(b, a.initiate())
    drain(a, b.accept(codec))
    return a, b


def test_nan_weights_are_refused():
    a, b = responder_after_offer()
    bad = torch.zeros(100)
    bad[42] = float("nan")
    with pytest.raises(RemoteProtocolError, match="NaN"):
        drain(b, join(a.send_vector(bad)))
    with pytest.raises(RemoteProtocolError):  # the exchange is dead from then on
        b.next_event()


def test_wrong_size_frames_and_a_truncated_stream():
    a, b = responder_after_offer(numel=100)
    other = av.Exchange("initiator", RUN, 3, 120, ["fp32"], chunk=60)
    other.state, other.codec = "SWAPPING", "fp32"  # a peer that lies about the size
    with pytest.raises(RemoteProtocolError):
        drain(b, join(other.send_vector(torch.zeros(120))))
    a, b = responder_after_offer(numel=100)
    data = join(a.send_vector(torch.ones(100)))
    assert drain(b, data[:-10]) and b.state == "SWAPPING"  # waits: NEED_DATA, not an error


def test_offers_for_another_run_absurd_sizes_and_unknown_codecs():
    b = av.Exchange("responder", RUN, None, None, ["fp32"], max_numel=1000)
    with pytest.raises(RemoteProtocolError, match="another run"):
        drain(b, av.Exchange("initiator", "QmOther", 1, 10, ["fp32"]).initiate())
    b = av.Exchange("responder", RUN, None, None, ["fp32"], max_numel=1000)
    with pytest.raises(RemoteProtocolError, match="limit"):
        drain(b, av.Exchange("initiator", RUN, 1, 10**9, ["fp32"]).initiate())
    assert av.negotiate(["zfp9", "int8"]) == "int8" and av.negotiate(["zfp9"]) == "fp32"
    with pytest.raises(RemoteProtocolError, match="unknown codec"):
        codecs.decode("zfp9", 10, b"")


def test_zstd_bomb_is_refused_without_expanding():
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * 10_000_000)
    with pytest.raises(RemoteProtocolError):
        codecs.decode("fp32+zstd", 100, bomb)


def test_reject_reaches_the_initiator():
    a = av.Exchange("initiator", RUN, 3, 10, ["fp32"])
    b = av.Exchange("responder", RUN, None, None, ["fp32"])
    drain(b, a.initiate())
    assert drain(a, b.reject("not my partner")) == [av.Rejected("not my partner")]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_give_events_or_remote_errors(data):
    b = av.Exchange("responder", RUN, None, None, ["fp32"])
    with contextlib.suppress(RemoteProtocolError):
        drain(b, data)
