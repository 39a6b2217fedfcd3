"""The "topk" codec (protocols/sparse.py) and its error feedback (node/ml/optim/compress.py):
round trips, the residual carrying exactly what was not sent, hostile frames refused before
allocation, anchor decoding against side information, and fallback negotiation."""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.ml.optim import NoLoCoConfig
from node.ml.optim.compress import (
    CompressedDiLoCo,
    CompressedNoLoCo,
    ErrorFeedback,
    TopKConfig,
    topk_indices,
)
from protocols import sparse
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.manifest import canonical_bytes, parse_manifest

BOUNDS = sparse.Bounds(max_density=1 / 4, max_value_bits=4, max_anchor_bits=8)


def _frame(numel: int = 1000, chunk: int = 256, k: int = 8, bits: int = 2, abits: int = 0,
           seed: int = 0) -> tuple[sparse.Frame, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    idx = topk_indices(x, chunk, k)
    kw = {}
    if abits:
        kw = {"anchor": x[idx] * 3, "eps": torch.full((sparse.n_chunks(numel, chunk),), 0.01),
              "anchor_bits": abits}
    return sparse.make_frame(numel, chunk, k, idx, x[idx], bits, **kw), x


@pytest.mark.parametrize(("numel", "chunk", "k", "bits", "abits"), [
    (1000, 256, 8, 2, 0), (1000, 256, 8, 4, 4), (4096 * 3 + 17, 4096, 64, 3, 2),
    (5, 64, 8, 2, 0), (64, 64, 64, 8, 16), (0, 64, 1, 2, 0)])
def test_round_trip_is_exact_and_sized_by_the_header(numel: int, chunk: int, k: int, bits: int,
                                                     abits: int) -> None:
    frame, _ = _frame(numel, chunk, k, bits, abits)
    payload = sparse.encode(frame)
    assert len(payload) == sparse.encoded_size(numel, chunk, k, bits, abits)
    bounds = sparse.Bounds(max_density=1, max_value_bits=8, max_anchor_bits=16)
    back = sparse.decode(payload, numel, bounds)
    assert torch.equal(back.indices, frame.indices)
    assert torch.equal(back.values, frame.values)
    assert np.array_equal(back.codes, frame.codes)
    if abits:
        assert np.array_equal(back.anchor_codes, frame.anchor_codes)
        assert np.array_equal(back.eps, frame.eps)
    assert back.indices.numel() == sparse.n_kept(numel, chunk, k)


def test_values_keep_sign_and_lie_between_the_chunks_scales() -> None:
    frame, x = _frame(4096, 256, 16, 3)
    assert torch.equal(torch.sign(frame.values), torch.sign(x[frame.indices]))
    err = (frame.values - x[frame.indices]).abs()
    # 3 bits: 4 magnitude levels from lo to hi, so the error is at most (hi - lo) / 6
    starts = sparse._chunk_starts(4096, 256, 16)
    span = torch.from_numpy(frame.hi - frame.lo).repeat_interleave(torch.from_numpy(starts).diff())
    assert bool((err <= span / 6 + 1e-6).all())


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 3000), chunk_bits=st.integers(6, 9), density=st.floats(0.01, 1.0),
       bits=st.integers(2, 4), decay=st.sampled_from([1.0, 0.95, 0.5]), seed=st.integers(0, 99),
       rounds=st.integers(1, 3))
def test_the_residual_carries_exactly_what_was_not_sent(numel: int, chunk_bits: int,
                                                       density: float, bits: int, decay: float,
                                                       seed: int, rounds: int) -> None:
    chunk = 1 << chunk_bits
    cfg = TopKConfig(chunk=chunk, density=max(density, 1 / chunk), value_bits=bits,
                     ef_decay=decay, anchor_bits=0)
    ef = ErrorFeedback(numel, cfg)
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        delta = torch.randn(numel, generator=g)
        acc = ef.e * decay + delta  # what this round had to send
        frame = ef.compress(delta)
        sent = frame.to_dense()
        unsent = torch.ones(numel, dtype=torch.bool)
        unsent[frame.indices] = False
        assert torch.equal(ef.e[unsent], acc[unsent])  # untouched, bit for bit
        assert torch.equal(ef.e[frame.indices], acc[frame.indices] - frame.values)
        torch.testing.assert_close(ef.e + sent, acc, rtol=0, atol=1e-5)
        # the top k: nothing left behind in a chunk is larger than what was chosen there
        for c in range(0, numel, chunk):
            seg = slice(c, min(c + chunk, numel))
            chosen = acc[seg][~unsent[seg]].abs()
            left = acc[seg][unsent[seg]].abs()
            if left.numel():
                assert float(left.max()) <= float(chosen.min())


def _patch(payload: bytes, offset: int, fmt: str, value: int | float) -> bytes:
    b = bytearray(payload)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def _with_indices(frame: sparse.Frame, local: list[int]) -> bytes:
    """The frame's bytes with its first chunk's in-chunk indices replaced."""
    payload = bytearray(sparse.encode(frame))
    nc = sparse.n_chunks(frame.numel, frame.chunk)
    off = sparse.HEADER_SIZE + nc * (3 if frame.anchor_bits else 2) * 4
    starts = sparse._chunk_starts(frame.numel, frame.chunk, frame.k)
    chunk_of = np.repeat(np.arange(nc), np.diff(starts))
    idx = frame.indices.numpy() - chunk_of * frame.chunk
    idx[: len(local)] = local
    packed = sparse._pack(idx, frame.chunk.bit_length() - 1)
    payload[off: off + len(packed)] = packed
    return bytes(payload)


def test_indices_out_of_range_repeated_or_unsorted_are_refused() -> None:
    frame, _ = _frame(1000, 256, 8)
    first = frame.indices[:8].tolist()
    with pytest.raises(RemoteProtocolError, match="repeated or unsorted"):
        sparse.decode(_with_indices(frame, [first[0], first[0]]), 1000, BOUNDS)
    with pytest.raises(RemoteProtocolError, match="repeated or unsorted"):
        sparse.decode(_with_indices(frame, [first[1], first[0]]), 1000, BOUNDS)
    # the last chunk holds 1000 - 768 = 232 values: an index of 240 fits 8 bits, not the chunk
    last, _ = _frame(1000, 256, 8)
    payload = bytearray(sparse.encode(last))
    starts = sparse._chunk_starts(1000, 256, 8)
    idx = last.indices.numpy() - np.repeat(np.arange(4), np.diff(starts)) * 256
    idx[-1] = 240
    off = sparse.HEADER_SIZE + 4 * 2 * 4
    packed = sparse._pack(idx, 8)
    payload[off: off + len(packed)] = packed
    with pytest.raises(RemoteProtocolError, match="out of range"):
        sparse.decode(bytes(payload), 1000, BOUNDS)


def test_header_fields_outside_the_runs_bounds_are_refused() -> None:
    frame, _ = _frame(1000, 256, 8)
    payload = sparse.encode(frame)
    tight = sparse.Bounds(max_density=1 / 64, max_value_bits=4, max_anchor_bits=0)
    with pytest.raises(RemoteProtocolError, match="density"):
        sparse.decode(payload, 1000, tight)
    wide, _ = _frame(1000, 256, 8, bits=4)
    with pytest.raises(RemoteProtocolError, match="4 bits are over"):
        sparse.decode(sparse.encode(wide), 1000, sparse.Bounds(max_value_bits=3))
    anchored, _ = _frame(1000, 256, 8, abits=4)
    with pytest.raises(RemoteProtocolError, match="anchor codes"):
        sparse.decode(sparse.encode(anchored), 1000, sparse.Bounds(max_anchor_bits=2,
                                                                   max_density=1))


@pytest.mark.parametrize(("offset", "fmt", "value", "match"), [
    (0, "<4s", b"XXXX", "not a topk"), (6, "<H", 2, "not a topk"),
    (4, "<B", 1, "value bits"), (4, "<B", 9, "value bits"), (5, "<B", 1, "anchor bits"),
    (8, "<I", 999, "values; 1000"), (12, "<I", 100, "power of two"), (12, "<I", 32, "power"),
    (16, "<I", 0, "k must"), (16, "<I", 257, "k must"),
])
def test_malformed_headers_are_refused(offset: int, fmt: str, value: object, match: str) -> None:
    frame, _ = _frame(1000, 256, 8)
    payload = _patch(sparse.encode(frame), offset, fmt, value)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError, match=match):
        sparse.decode(payload, 1000, sparse.Bounds(max_density=1, max_value_bits=8))


def test_sizes_are_checked_before_anything_is_allocated() -> None:
    frame, _ = _frame(1000, 256, 8)
    payload = sparse.encode(frame)
    for bad in (payload[:-1], payload + b"\0", payload[:10], b""):
        with pytest.raises(RemoteProtocolError):
            sparse.decode(bad, 1000, BOUNDS)
    # a 20-byte header claiming 2^32 - 1 values at full density: refused on the numel we
    # expect, and a receiver expecting that many refuses it on size, allocating nothing
    huge = struct.pack("<4sBBHIII", b"PTK1", 2, 0, 0, 2**32 - 1, 65536, 65536)
    with pytest.raises(RemoteProtocolError, match="expected"):
        sparse.decode(huge, 1000, BOUNDS)
    with pytest.raises(RemoteProtocolError, match="header says"):
        sparse.decode(huge, 2**32 - 1, sparse.Bounds(max_density=1))


@pytest.mark.parametrize(("col", "value", "match"), [
    (0, float("nan"), "NaN"), (1, float("inf"), "NaN"), (0, -1.0, "lo <= hi"),
    (0, 1e9, "lo <= hi")])
def test_bad_scales_are_refused(col: int, value: float, match: str) -> None:
    frame, _ = _frame(1000, 256, 8)
    payload = _patch(sparse.encode(frame), sparse.HEADER_SIZE + 4 * col, "<f", value)
    with pytest.raises(RemoteProtocolError, match=match):
        sparse.decode(payload, 1000, BOUNDS)


def test_anchor_decodes_against_side_information_and_stays_bounded() -> None:
    numel, chunk, k, abits = 4096, 256, 32, 4
    g = torch.Generator().manual_seed(3)
    phi_sender = torch.randn(numel, generator=g)
    eps = torch.full((numel // chunk,), 0.01)
    idx = topk_indices(torch.randn(numel, generator=g), chunk, k)
    frame = sparse.make_frame(numel, chunk, k, idx, torch.ones(idx.numel()), 2,
                              anchor=phi_sender[idx], eps=eps, anchor_bits=abits)
    frame = sparse.decode(sparse.encode(frame), numel, BOUNDS)
    near = phi_sender + (torch.rand(numel, generator=g) - 0.5) * 0.1  # |drift| < 0.05 < 7.5 eps
    est = sparse.anchor_estimate(frame, near)
    assert float((est - phi_sender[idx]).abs().max()) <= 0.005 + 1e-6
    far = phi_sender + 5.0  # far outside the grid's range: wrong, but never far from ours
    est = sparse.anchor_estimate(frame, far)
    assert float((est - far[idx]).abs().max()) <= 0.01 * (8 + 1) + 1e-5


def test_negotiation_prefers_topk_and_falls_back_once_per_peer(
        caplog: pytest.LogCaptureFixture) -> None:
    assert sparse.negotiate(["topk", "bf16"], ["topk", "bf16", "fp32"], peer="a") == "topk"
    caplog.set_level(logging.WARNING, logger="protocols.sparse")
    for _ in range(3):  # an older peer: it offers only dense codecs
        assert sparse.negotiate(["bf16", "fp32"], ["topk", "bf16"], peer="old") == "bf16"
    for _ in range(2):  # we offer topk to a peer that does not know it
        assert sparse.negotiate(["topk", "int8"], ["int8", "fp32"], peer="older") == "int8"
    assert sparse.negotiate(["topk"], ["bf16"], peer="oldest") == "fp32"
    warnings = [r for r in caplog.records if r.name == "protocols.sparse"]
    assert len(warnings) == 3
    assert all("topk" in r.getMessage() for r in warnings)


def test_manifest_bounds_reach_the_decoder_and_defaults_keep_the_run_id() -> None:
    base = parse_manifest(b'[run]\nname = "t"\n')
    assert b"topk" not in canonical_bytes(base)
    tight = parse_manifest(b'[run]\nname = "t"\n[outer]\ntopk_max_density = 0.01\n')
    assert b"topk_max_density" in canonical_bytes(tight)
    frame, _ = _frame(1000, 256, 8)
    with pytest.raises(RemoteProtocolError, match="density"):
        sparse.decode(sparse.encode(frame), 1000, sparse.bounds_of(tight.outer))
    sparse.decode(sparse.encode(frame), 1000, sparse.bounds_of(base.outer))


def test_misuse_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        sparse.make_frame(10, 64, 4, torch.arange(3), torch.ones(3), 2)  # 4 kept, not 3
    with pytest.raises(LocalProtocolError):
        sparse.make_frame(10, 64, 4, torch.arange(4), torch.tensor([1.0, 2, 3, float("nan")]), 2)
    frame, _ = _frame()
    with pytest.raises(LocalProtocolError):
        sparse.anchor_estimate(frame, torch.zeros(1000))


def test_compressed_noloco_step_matches_the_rule_by_hand() -> None:
    g = torch.Generator().manual_seed(5)
    n = 512
    init = torch.randn(n, generator=g)
    cfg = TopKConfig(chunk=128, density=1 / 8, value_bits=4, anchor_bits=8, keep_residual=0.0)
    a = CompressedNoLoCo(init, NoLoCoConfig(outer_lr=0.7, momentum=0.5), cfg)
    b = CompressedNoLoCo(init, NoLoCoConfig(outer_lr=0.7, momentum=0.5), cfg)
    b.phi += 0.01 * torch.randn(n, generator=g)  # anchors that differ
    b.m += 0.01
    ta, tb = init + 0.1 * torch.randn(n, generator=g), init + 0.1 * torch.randn(n, generator=g)
    fa, fb = a.prepare(ta), b.prepare(tb)
    fb_wire = sparse.decode(sparse.encode(fb), n, sparse.Bounds(max_density=1))
    phi0, m0 = a.phi.clone(), a.m.clone()
    d = fa.to_dense() + fb.to_dense()
    d[fb.indices] += sparse.anchor_estimate(fb_wire, phi0) - phi0[fb.indices]
    d /= 2
    m = 0.5 * m0 + 0.7 * d
    out = a.outer_step(fa, [fb_wire])
    torch.testing.assert_close(a.m, m)
    torch.testing.assert_close(out, phi0 + m)
    # b's anchor at b's sent indices, decoded by a, is within a's grid step of the truth
    # (a's m was 0, so b's grid comes from b's own m: 0.01 * 2 * 4 / 256)
    est = sparse.anchor_estimate(fb_wire, phi0)
    assert float((est - b.phi[fb.indices]).abs().max()) <= 0.01 * 8 / 256 / 2 + 1e-6


def test_keep_residual_leaves_the_unsent_progress_in_the_model() -> None:
    g = torch.Generator().manual_seed(6)
    init = torch.randn(256, generator=g)
    cfg = TopKConfig(chunk=64, density=1 / 16, anchor_bits=0, keep_residual=1.0)
    opt = CompressedNoLoCo(init, NoLoCoConfig(outer_lr=1.0, momentum=0.0), cfg)
    theta = init + torch.randn(256, generator=g)
    own = opt.prepare(theta)
    weights = opt.outer_step(own)  # alone: φ ← φ + C, and the model keeps θ − φ − C
    torch.testing.assert_close(weights, theta, rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.phi, init + own.to_dense())
    # the next round sends from θ − φ, which already holds the residual: not counted twice
    nxt = opt.prepare(weights)
    assert float(nxt.to_dense().abs().sum()) > 0
    torch.testing.assert_close(opt.ef.e + nxt.to_dense(), weights - opt.phi, rtol=0, atol=1e-6)


def test_compressed_diloco_workers_agree_on_phi() -> None:
    g = torch.Generator().manual_seed(7)
    init = torch.randn(300, generator=g)
    cfg = TopKConfig(chunk=64, density=1 / 8, anchor_bits=0, ef_decay=0.95, keep_residual=0.0)
    workers = [CompressedDiLoCo(init, topk=cfg) for _ in range(3)]
    frames = [w.prepare(init - 0.1 * torch.randn(300, generator=g)) for w in workers]
    outs = [w.outer_step(frames) for w in workers]
    assert all(torch.equal(o, outs[0]) for o in outs)
    mean = sum(f.to_dense() for f in frames) / 3
    torch.testing.assert_close(outs[0], init - mean)  # SparseLoCo: η 1, no momentum


def test_dct_frames_round_trip_their_flag_and_the_transform_is_orthonormal() -> None:
    from node.ml.optim.compress import ChunkDCT

    g = torch.Generator().manual_seed(8)
    v = torch.randn(64 * 3 + 10, generator=g)
    t = ChunkDCT(64)
    c = t.forward(v)
    torch.testing.assert_close(t.inverse(c), v, rtol=0, atol=1e-5)
    torch.testing.assert_close(c.norm(), v.norm())
    # a smooth vector's energy sits in few coefficients: what the DCT is for
    ramp = torch.linspace(0, 1, 64)
    assert float(t.forward(ramp)[:4].pow(2).sum() / ramp.pow(2).sum()) > 0.99
    cfg = TopKConfig(chunk=64, density=1 / 8, anchor_bits=2, dct=True, keep_residual=1.0)
    a = CompressedNoLoCo(v, NoLoCoConfig(), cfg)
    frame = a.prepare(v + 0.1 * torch.randn(v.numel(), generator=g))
    assert frame.dct
    back = sparse.decode(sparse.encode(frame), v.numel(), BOUNDS)
    assert back.dct and torch.equal(back.values, frame.values)
    # the residual, mapped back to the weights, plus what was sent is the whole step
    sent = t.inverse(frame.to_dense())
    before = a.phi.clone()
    weights = a.outer_step(frame)
    torch.testing.assert_close(weights, before + 0.7 * sent + t.inverse(a.ef.e), rtol=0,
                               atol=1e-5)


def test_a_stream_reader_learns_the_frames_size_from_its_header_alone() -> None:
    frame, _ = _frame(1000, 256, 8, abits=4)
    payload = sparse.encode(frame)
    head = payload[: sparse.HEADER_SIZE]
    assert sparse.frame_size(head, 1000, BOUNDS) == len(payload)
    with pytest.raises(RemoteProtocolError, match="density"):
        sparse.frame_size(head, 1000, sparse.Bounds(max_density=1 / 64))
    with pytest.raises(RemoteProtocolError, match="shorter"):
        sparse.frame_size(head[:19], 1000, BOUNDS)
