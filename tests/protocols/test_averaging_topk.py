"""The codec "topk" in the sans-IO exchange (protocols/averaging.py): bundles of encoded
sparse frames, any split of the byte stream, and what is refused before it is buffered."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.ml.optim.compress import CompressedNoLoCo
from protocols import averaging as av
from protocols import sparse
from protocols.errors import LocalProtocolError
from protocols.wire import Envelope, encode_envelope, encode_tensor_frame, make_tensor_header
from tests.protocols.test_averaging import RUN, S, feed, refuses

NUMEL = 48 * 4096 + 37  # frames of about 6 KB: several pieces each
CHUNK = 256  # pieces of 1 KiB: several per frame
BOUNDS = sparse.Bounds()


def payload(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    opt = CompressedNoLoCo(torch.randn(NUMEL, generator=g))
    return sparse.encode(opt.prepare(opt.phi + torch.randn(NUMEL, generator=g)))


def agreed(max_bundle: int = 1) -> tuple[av.Exchange, av.Exchange]:
    a = av.Exchange("initiator", RUN, 3, NUMEL, ["topk"], chunk_elems=CHUNK,
                    topk_bounds=BOUNDS, max_bundle=max_bundle)
    b = av.Exchange("responder", RUN, None, None, ["topk", "fp32"], topk_bounds=BOUNDS,
                    max_bundle=max_bundle)
    feed(b, a.initiate())
    feed(a, b.accept("topk"))
    return a, b


@settings(max_examples=20, deadline=None)
@given(cuts=st.lists(st.integers(1, 20_000), max_size=6), n=st.integers(1, 3))
def test_bundles_arrive_decoded_whatever_the_split(cuts, n):
    a, b = agreed(max_bundle=3)
    frames = [payload(i) for i in range(n)]
    events = feed(b, a.send_frames(frames), cuts)
    assert isinstance(events[-1], av.PeerDone) and b.state is S.DONE
    got = b.received_frames()
    assert [sparse.encode(f) for f in got] == frames
    assert sum(e.nbytes for e in events[:-1]) == sum(len(f) for f in frames)


def test_a_bundle_over_the_receivers_limit_is_refused_on_the_next_header():
    a, b = agreed(max_bundle=1)
    refuses(b, a.send_frames([payload(0), payload(1)]), "more than 1 topk frames")


def _raw(name: str, data: bytes) -> list:
    header = make_tensor_header(name, "uint8", (len(data),), "topk", data)
    return encode_tensor_frame(header, data, id=3)


def test_a_piece_of_the_wrong_size_is_refused_on_its_header():
    _, b = agreed()
    data = payload(0)
    head = _raw("topk/0", data[: sparse.HEADER_SIZE])
    refuses(b, [*head, *_raw("topk/0/0", data[sparse.HEADER_SIZE: sparse.HEADER_SIZE + 99])],
            "1024 uint8 were expected")


def test_a_header_over_the_runs_bounds_is_refused_before_the_frame_is_allocated():
    tight = av.Exchange("responder", RUN, None, None, ["topk"],
                        topk_bounds=sparse.Bounds(max_density=1 / 128))
    a2 = av.Exchange("initiator", RUN, 3, NUMEL, ["topk"], chunk_elems=CHUNK,
                     topk_bounds=BOUNDS)
    feed(tight, a2.initiate())
    feed(a2, tight.accept("topk"))
    refuses(tight, _raw("topk/0", payload(0)[: sparse.HEADER_SIZE]), "over the run's bound")


def test_done_before_a_frame_is_whole_is_refused():
    _, b = agreed()
    data = payload(0)
    head = _raw("topk/0", data[: sparse.HEADER_SIZE])
    piece = _raw("topk/0/0", data[sparse.HEADER_SIZE : sparse.HEADER_SIZE + 4 * CHUNK])
    done = encode_envelope(Envelope("avg.done", 3, {"round": 3, "frames": 2}))
    refuses(b, [*head, *piece, done], "whole topk frames")


def test_misuse_is_a_local_error():
    with pytest.raises(LocalProtocolError, match="bounds"):
        av.Exchange("initiator", RUN, 3, NUMEL, ["topk"])
    a, _ = agreed()
    with pytest.raises(LocalProtocolError, match="not a frame"):
        a.send_frames([b"short"])
    dense_a = av.Exchange("initiator", RUN, 3, NUMEL, ["fp32"])
    dense_b = av.Exchange("responder", RUN, None, None, ["fp32"])
    feed(dense_b, dense_a.initiate())
    with pytest.raises(LocalProtocolError, match="topk"):
        dense_b.accept("topk")
