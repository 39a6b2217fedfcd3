"""Tensor codecs for the weight exchange (protocols/codecs.py): round trips, limits, refusals."""

from __future__ import annotations

import struct
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import codecs
from protocols.errors import LocalProtocolError, RemoteProtocolError

SIZES = [1, 7, 4095, 4096, 4097, 3 * 4096 + 5]
TOLERANCE = {"fp32": 0.0, "bf16": 4e-3, "int8": 2e-2}


def roundtrip(vec: torch.Tensor, codec: str, **kw) -> torch.Tensor:
    enc = codecs.encode(vec, codec)
    assert enc.codec == codec and enc.dtype == codecs.dtype_of(codec)
    assert enc.shape == (vec.numel(),)
    return codecs.decode(codec, enc.dtype, list(enc.shape), enc.payload, vec.numel(), **kw)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("n", SIZES)
def test_base_codecs_round_trip_within_their_error(codec, n):
    torch.manual_seed(n)
    vec = torch.randn(n) * 0.02
    got = roundtrip(vec, codec)
    assert got.dtype == torch.float32 and got.shape == (n,)
    if codec == "fp32":
        assert torch.equal(got, vec)
    elif n > 100:  # a handful of values says nothing about an L2 error
        assert rel_l2(got, vec) <= TOLERANCE[codec]
    size = len(memoryview(codecs.encode(vec, codec).payload).cast("B"))
    assert size == codecs.max_encoded_size(codec, n)


@pytest.mark.parametrize("base", ["fp32", "bf16"])
@pytest.mark.parametrize("n", SIZES)
def test_zstd_variants_are_exact_with_respect_to_their_base(base, n):
    vec = torch.randn(n) * 0.02
    vec[: n // 2] = 0.0  # something to compress
    assert torch.equal(roundtrip(vec, base + "+zstd"), roundtrip(vec, base))
    payload = codecs.encode(vec, base + "+zstd").payload
    assert len(payload) <= codecs.max_encoded_size(base + "+zstd", n)
    assert zstandard.frame_content_size(payload) == n * (4 if base == "fp32" else 2)


def test_int8_layout_is_scales_then_values():
    vec = torch.zeros(4096 + 3)
    vec[10], vec[4096 + 1] = -0.5, 2.0
    payload = bytes(codecs.encode(vec, "int8").payload)
    assert struct.unpack("<2f", payload[:8]) == (0.5, 2.0)  # absmax of each chunk
    q = np.frombuffer(payload[8:], dtype=np.int8)
    assert q.size == vec.numel() and q[10] == -127 and q[4096 + 1] == 127
    assert np.count_nonzero(q) == 2


def test_fp32_encoding_does_not_copy_and_decoding_gives_a_writable_vector():
    vec = torch.randn(1000)
    enc = codecs.encode(vec, "fp32")
    assert np.frombuffer(enc.payload, dtype=np.uint8).ctypes.data == vec.data_ptr()
    for codec in codecs.CODECS:
        enc = codecs.encode(vec, codec)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns about non-writable buffers
            got = codecs.decode(codec, enc.dtype, enc.shape, bytes(enc.payload), 1000)
        want = got.clone()
        got += 1  # writable, and not aliasing anything the caller still holds
        out = torch.full((1000,), 7.0)
        assert codecs.decode(codec, enc.dtype, enc.shape, enc.payload, 1000, out=out) is out
        assert torch.equal(out, want)


def test_special_vectors():
    for codec in codecs.CODECS:
        assert torch.equal(roundtrip(torch.zeros(5000), codec), torch.zeros(5000))
        assert roundtrip(torch.empty(0), codec).shape == (0,)
        tiny = torch.full((10,), 1e-44)  # denormal: int8 must not divide by an underflowed step
        assert torch.isfinite(roundtrip(tiny, codec)).all()


# --- what a peer may send -------------------------------------------------------------


def zstd_frame_claiming(content_size: int, block: bytes = b"\x01") -> bytes:
    """A hand-made zstd frame whose header claims `content_size` bytes (and holds one)."""
    descriptor = 3 << 6 | 1 << 5  # 8-byte content size, single segment
    block_header = (1 | len(block) << 3).to_bytes(3, "little")  # last block, raw
    return struct.pack("<IBQ", 0xFD2FB528, descriptor, content_size) + block_header + block


def test_a_frame_claiming_a_huge_size_allocates_nothing():
    # zstandard's decompress() would allocate the claimed 500 MB before failing.
    bomb = zstd_frame_claiming(500_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match="claims 500000000 bytes"):
            codecs.decode("fp32+zstd", "float32", [100], bomb, 100)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_a_frame_without_a_size_is_not_inflated_past_the_expected_size():
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=False)
    bomb = compressor.compress(b"\0" * 50_000_000)  # ~2 KB
    assert zstandard.frame_content_size(bomb) == -1  # unknown (not CONTENTSIZE_UNKNOWN!)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match="zstd"):
            codecs.decode("fp32+zstd", "float32", [100], bomb, 100)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    honest = compressor.compress(b"\0" * 400)  # without a size but the right one: fine
    assert torch.equal(codecs.decode("fp32+zstd", "float32", [100], honest, 100), torch.zeros(100))


def test_zstd_payloads_that_are_not_exactly_one_right_frame_are_refused():
    good = codecs.encode(torch.randn(100), "bf16+zstd").payload
    bad = {
        "trailing": good + b"\0",
        "two frames": good + good,
        "truncated": good[:-1],
        "not zstd": b"\0" * len(good),
        "empty": b"",
        "short content": zstandard.compress(b"\0" * 198),
        "over the bound": good + b"\0" * codecs.max_encoded_size("bf16+zstd", 100),
    }
    for what, payload in bad.items():
        with pytest.raises(RemoteProtocolError):
            codecs.decode("bf16+zstd", "bfloat16", [100], payload, 100)
            pytest.fail(what)


@pytest.mark.parametrize("codec", codecs.CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused(codec, bad):
    vec = torch.randn(5000)
    vec[4321] = bad
    with pytest.raises(RemoteProtocolError, match="contains NaN/Inf"):
        roundtrip(vec, codec)


def test_int8_scales_that_overflow_are_refused_quietly():
    payload = bytearray(codecs.encode(torch.ones(10), "int8").payload)
    payload[:4] = struct.pack("<f", 3.4e38)
    payload[4] = 0x80  # q = -128: -128/127 * 3.4e38 is -inf in float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning in the daemon's log
        with pytest.raises(RemoteProtocolError, match="NaN/Inf"):
            codecs.decode("int8", "int8", [10], payload, 10)
    payload[:4] = struct.pack("<f", float("nan"))
    with pytest.raises(RemoteProtocolError, match="NaN/Inf"):
        codecs.decode("int8", "int8", [10], payload, 10)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_payloads_of_the_wrong_length_are_refused(codec):
    enc = codecs.encode(torch.randn(100), codec)
    payload = bytes(enc.payload)
    for wrong in (payload[:-1], payload + b"\0", b"", payload * 2):
        with pytest.raises(RemoteProtocolError, match="payload of"):
            codecs.decode(codec, enc.dtype, [100], wrong, 100)


def test_descriptions_that_disagree_are_refused():
    enc = codecs.encode(torch.randn(100), "bf16")
    cases = [
        ("bf16", "float32", [100], "announced as bfloat16"),
        ("bf16", "bfloat16", [99], "expected shape"),
        ("bf16", "bfloat16", [10, 10], "expected shape"),
        ("bf16", "bfloat16", [True], "expected shape"),
        ("bf16", "bfloat16", "100", "expected shape"),
        ("zfp9", "bfloat16", [100], "unknown codec"),
        (None, "bfloat16", [100], "unknown codec"),
    ]
    for codec, dtype, shape, message in cases:
        with pytest.raises(RemoteProtocolError, match=message):
            codecs.decode(codec, dtype, shape, enc.payload, 100)


def test_the_header_checks_run_without_the_payload():
    """check_header is decode's refusals on a tensor header, before any payload arrives."""
    codecs.check_header("bf16", "bfloat16", [100], 200, 100)
    codecs.check_header("fp32+zstd", "float32", [100], 17, 100)
    cases = [
        (("bf16", "float32", [100], 200), "announced as bfloat16"),
        (("bf16", "bfloat16", [99], 200), "expected shape"),
        (("bf16", "bfloat16", [100], 199), "payload of 199 bytes"),
        (("int8", "int8", [100], 100), "payload of 100 bytes; 100 values take 104"),
        (("fp32+zstd", "float32", [100], 10**6), "over the"),
        (("zfp9", "float32", [100], 400), "unknown codec"),
    ]
    for args, message in cases:
        with pytest.raises(RemoteProtocolError, match=message):
            codecs.check_header(*args, 100)


def test_an_fp32_payload_already_in_out_is_only_checked():
    """Received straight into the receive vector: decode checks it and copies nothing."""
    out = torch.randn(1000)
    before = out.clone()
    payload = memoryview(out.numpy()).cast("B")
    assert codecs.decode("fp32", "float32", [1000], payload, 1000, out=out) is out
    assert torch.equal(out, before)
    out[7] = float("inf")
    with pytest.raises(RemoteProtocolError, match="NaN/Inf"):
        codecs.decode("fp32", "float32", [1000], payload, 1000, out=out)


def test_our_own_mistakes_are_local_errors():
    for vec in (torch.randn(10, 10), torch.randn(20)[::2], torch.randn(10).double(), [1.0]):
        with pytest.raises(LocalProtocolError):
            codecs.encode(vec, "fp32")
    with pytest.raises(LocalProtocolError):
        codecs.encode(torch.randn(10), "zfp9")
    with pytest.raises(LocalProtocolError):
        codecs.decode("fp32", "float32", [10], bytes(40), 10, out=torch.empty(11))


def test_negotiation_takes_the_offerers_first_choice_that_the_other_supports():
    assert codecs.negotiate(["int8", "bf16"], ["bf16", "int8"]) == "int8"
    assert codecs.negotiate(["zfp9", "bf16+zstd", "bf16"], ["bf16"]) == "bf16"
    assert codecs.negotiate(["int8"], ["bf16"]) == "fp32"  # always possible
    assert codecs.negotiate([], ["bf16"]) == "fp32"
    assert codecs.negotiate(["zfp9"], ["zfp9"]) == "fp32"  # not one this module speaks
    assert codecs.negotiate(["fp32+zstd"]) == "fp32+zstd"  # default: everything known


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(codecs.CODECS),
    st.integers(0, 300),
    st.binary(max_size=1300),
)
def test_fuzz_any_payload_decodes_or_is_refused(codec, numel, payload):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            got = codecs.decode(codec, codecs.dtype_of(codec), [numel], payload, numel)
        except RemoteProtocolError:
            return
    assert got.shape == (numel,) and bool(torch.isfinite(got).all())
