"""One fuzz target per decoder in protocols/, each with the invariant it checks.

Every target takes arbitrary bytes (the peer's, or a file's) and must end in one of two
ways: a value, or the exception the decoder documents for refused input (`TARGETS`).
Anything else escaping (TypeError, KeyError, RecursionError, MemoryError, ...) is a crash:
a bug to fix in protocols/, with a regression test. Targets that take more than bytes (the
limits, how the stream is split, a codec) read them from the first bytes of the input, in
a fixed layout, so the fuzzer explores them too and a valid seed is exact.

No atheris import here: tests/protocols/test_fuzz.py replays seeds and found inputs without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Final

import torch

from protocols import averaging as av
from protocols import (
    checkpoint,
    codecs,
    heartbeat,
    history,
    keys,
    lane,
    records,
    rundoc,
    stun,
    webrtc_signal,
)
from protocols import ckpt_exchange as cx
from protocols import manifest as mf
from protocols import manifest_exchange as mx
from protocols import pipeline as pipe
from protocols.errors import RemoteProtocolError
from protocols.wire import (
    NEED_DATA,
    Envelope,
    FrameDecoder,
    TensorFrame,
    TensorHeader,
    encode_tensor_frame,
    make_tensor_header,
    tensor_from_payload,
)

REPO: Final = Path(__file__).resolve().parents[2]
RUN: Final = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"
SIGNER: Final = keys.Signer(bytes(range(32)))  # fixed: seeds and runs are reproducible
OTHER: Final = keys.Signer(bytes(range(1, 33)))
HISTORY_LEN: Final = 16
MAX_FUZZ_NUMEL: Final = 1 << 16  # what the target's caller accepts (its model size)

DECODERS: Final = {
    "request": mx.REQUEST_LIMITS,
    "avg": av.LIMITS,
    "meta": rundoc.SYNC_LIMITS,
}


def _pieces(stream: bytes, size_byte: int) -> list[bytes]:
    """`stream` cut into pieces of 1 + size_byte**2 // 16 bytes (1 B .. 4 KiB)."""
    step = 1 + size_byte * size_byte // 16
    return [stream[i : i + step] for i in range(0, len(stream), step)]


def _events(decoder: FrameDecoder, pieces: list[bytes]) -> list[Envelope | TensorFrame]:
    """Feed `pieces` in order, written in place where the decoder offers room."""
    events: list[Envelope | TensorFrame] = []
    for piece in pieces:
        while piece:
            room = decoder.receive_buffer()
            if room is None:
                decoder.feed(piece)
                piece = b""
            else:
                n = min(len(room), len(piece))
                room[:n] = piece[:n]
                del room
                decoder.received_into(n)
                piece = piece[n:]
            while (event := decoder.next_event()) is not NEED_DATA:
                events.append(event)
    return events


def wire_frames(data: bytes) -> None:
    """FrameDecoder under any declared limits, with or without crc32, into its own buffer
    or the caller's, fed in any split: events or RemoteProtocolError, and a tensor frame
    whose header is raw has exactly its announced bytes and becomes a tensor.
    Layout: [limits and flags][piece size] stream."""
    if len(data) < 2:
        return
    config = data[0]
    limits = DECODERS[sorted(DECODERS)[config % len(DECODERS)]]
    in_place = bool(config & 4)

    def callers(header: TensorHeader) -> memoryview | None:
        return memoryview(bytearray(header.length)) if in_place else None

    decoder = limits.decoder(require_crc32=not config & 8, payload_buffer=callers)
    decoder.allowed_codecs = decoder.allowed_codecs | {"raw"}
    for event in _events(decoder, _pieces(data[2:], data[1])):
        if isinstance(event, TensorFrame):
            assert event.payload.nbytes == event.header.length
            if event.header.codec == "raw":
                tensor_from_payload(event.header, event.payload)


def averaging_exchange(data: bytes) -> None:
    """A responder Exchange fed the peer's bytes: it accepts an offer of a size its caller
    would (at most MAX_FUZZ_NUMEL values), then takes the vector. Events or
    RemoteProtocolError; a completed vector has the agreed size and only finite values.
    Layout: [piece size] stream."""
    if not data:
        return
    ex = av.Exchange("responder", RUN, None, None, codecs.CODECS)
    for piece in _pieces(data[1:], data[0]):
        ex.receive_data(piece)
        while (event := ex.next_event()) is not NEED_DATA:
            if isinstance(event, av.OfferReceived):
                if event.numel > MAX_FUZZ_NUMEL:
                    ex.reject("too large")
                    return
                ex.accept(av.negotiate(event.codecs))
            elif isinstance(event, av.PeerDone):
                vec = ex.received_vector()
                assert vec.numel() == ex.numel and bool(torch.isfinite(vec).all())


PIPE_EXPECT: Final = pipe.Expect(RUN, 2, d_model=8, max_batch=4, max_seq=16, micro_batches=4)


def pipe_stream(data: bytes) -> None:
    """A stage's PipeReceiver fed a peer's bytes: events or RemoteProtocolError; every
    received tensor fits what the stage declared and is finite. Layout: [piece size]
    stream."""
    if not data:
        return
    rx = pipe.PipeReceiver(PIPE_EXPECT)
    for piece in _pieces(data[1:], data[0]):
        rx.receive_data(piece)
        while (event := rx.next_event()) is not NEED_DATA:
            if isinstance(event, pipe.TensorReceived):
                b, t, d = event.tensor.shape
                assert b <= 4 and t <= 16 and d == 8
                assert bool(torch.isfinite(event.tensor).all())


CODEC_NAMES: Final = (*codecs.CODECS, "lz4")
DTYPE_NAMES: Final = ("float32", "bfloat16", "int8", "float16")


def codec_config(codec: str, numel: int, announced: int | None = None) -> bytes:
    """The 5-byte prefix of a codecs input: codec, its own dtype, numel, announced shape."""
    dtype = DTYPE_NAMES.index(codecs.dtype_of(codec))
    shape = numel if announced is None else announced
    return bytes([CODEC_NAMES.index(codec), dtype]) + numel.to_bytes(2) + bytes([shape != numel])


def codecs_decode(data: bytes) -> None:
    """codecs.decode of any payload under any (codec, dtype, shape) for a size the receiver
    expects: finite float32 values of that size, or RemoteProtocolError.
    Layout: [codec][dtype][numel: u16][shape is numel + 1?] payload."""
    if len(data) < 5:
        return
    codec = CODEC_NAMES[data[0] % len(CODEC_NAMES)]
    dtype = DTYPE_NAMES[data[1] % len(DTYPE_NAMES)]
    numel = int.from_bytes(data[2:4]) % (1 << 13)
    shape = [numel + (data[4] & 1)]
    out = codecs.decode(codec, dtype, shape, data[5:], numel)
    assert out.dtype == torch.float32 and out.numel() == numel
    assert bool(torch.isfinite(out).all())


def manifest_toml(data: bytes) -> None:
    """parse_manifest of any bytes: a Manifest, or ManifestError (a ValueError)."""
    mf.parse_manifest(data)


def manifest_canonical(data: bytes) -> None:
    """parse_canonical (what a joiner runs on a peer's answer) of any bytes, with no
    expected run-id so the hash check does not stop everything: a Manifest whose canonical
    bytes are the input, or ManifestError."""
    manifest = mf.parse_canonical(data)
    assert mf.canonical_bytes(manifest) == data


def exchange_messages(data: bytes) -> None:
    """The manifest and checkpoint exchanges' request and response parsers over decoded
    envelopes: a value, RemoteProtocolError, LookupError (the peer said "not held here"),
    or ManifestError (bytes that are not the run's manifest).
    Layout: [which parser] stream."""
    if not data:
        return
    kind = data[0] % 4
    decoder = (mx.REQUEST_LIMITS if kind % 2 == 0 else cx.RESPONSE_LIMITS).decoder()
    for env in _events(decoder, [data[1:]]):
        assert isinstance(env, Envelope)
        if kind == 0:
            mx.parse_request(env)
        elif kind == 1:
            mx.parse_response(env, env.id, RUN)
        elif kind == 2:
            cx.parse_request(env)
        else:
            cx.parse_response(env, env.id, env.type)


def rundoc_merge(data: bytes) -> None:
    """A replica's remote inputs: merge of a delta, delta_since of a summary, from_bytes
    of a saved state. A result, or RemoteProtocolError; a merge leaves a document that
    still encodes, answers anti-entropy, and whose rejected entries did not change it.
    Layout: [which input] bytes."""
    if not data:
        return
    which, rest = data[0] % 3, data[1:]
    doc = rundoc.RunDocument(RUN, SIGNER, [SIGNER.peer_id])
    if which == 0:
        result = doc.merge(rest, now_ms=1_700_000_000_000)
        assert len(doc) == len(result.applied)
        doc.delta_since(doc.summary())
        doc.to_bytes()
    elif which == 1:
        doc.set(f"peer/{SIGNER.peer_id}/addrs", ["/ip4/1.2.3.4"], 1_700_000_000_000)
        doc.delta_since(rest)
    else:
        rundoc.RunDocument.from_bytes(rest, RUN, SIGNER, [SIGNER.peer_id]).to_bytes()


def heartbeat_decode(data: bytes) -> None:
    """heartbeat.decode of any gossip message: a Heartbeat of its sender, or
    RemoteProtocolError."""
    hb = heartbeat.decode(data, SIGNER.peer_id)
    assert hb.peer == SIGNER.peer_id


def records_decode(data: bytes) -> None:
    """records.decode / select of any DHT value: a PeerRecord of the key's peer, or
    RemoteProtocolError; select never raises and picks an index in range."""
    key = records.peer_key(SIGNER.peer_id)
    assert records.select(key, [data, data]) in (0, 1)
    record = records.decode(key, data)
    assert record.peer_id == SIGNER.peer_id


def history_decode(data: bytes) -> None:
    """decode_history of any message (the history stream's bytes): a SignedHistory of the
    expected length, or HistoryError (a RemoteProtocolError)."""
    msg = history.decode_history(
        data, run_id=RUN, expected_len=HISTORY_LEN,
        max_bytes=history.LIMITS.for_model(HISTORY_LEN).max_envelope_bytes,
    )
    assert msg.vector.numel() == HISTORY_LEN


def checkpoint_manifest(data: bytes) -> None:
    """checkpoint.decode of any manifest bytes: a CheckpointManifest whose chunk list
    covers its size, or RemoteProtocolError."""
    m = checkpoint.decode(data)
    assert len(m.chunks) == -(-m.size // m.chunk)


def lane_records(data: bytes) -> None:
    """The lane's record reader: check_length of any 4-byte header, then open/open_into of
    any record under a fixed key: a length in range, plaintext, or RemoteProtocolError."""
    opener = lane.Opener(bytes(32), 0)
    n = lane.Opener.check_length(data[:4].ljust(4, b"\0"))
    assert 16 <= n <= lane.MAX_RECORD
    record = data[4 : 4 + n]
    opener.open_into(record, memoryview(bytearray(max(0, len(record) - lane.TAG_BYTES))))


def peer_ids(data: bytes) -> None:
    """keys.public_key_from_peer_id and verify of any text: 32 key bytes whose id is the
    input, a bool, or RemoteProtocolError. Layout: signature (64 bytes) text (UTF-8)."""
    signature, text = data[:64], data[64:].decode("utf-8", "replace")
    raw = keys.public_key_from_peer_id(text)
    assert len(raw) == 32 and keys.peer_id_from_public_key(raw) == text
    assert keys.verify(text, b"x", signature) in (True, False)


#: name -> (target, the exceptions that mean "refused", as documented by the decoder)
def stun_messages(data: bytes) -> None:
    """The STUN codec (protocols/stun.py): a Binding Request the responder would answer,
    or a Binding Success a probe would read. Layout: [which parser] datagram."""
    if not data:
        return
    if data[0] % 2 == 0:
        req = stun.parse_request(data[1:])
        assert len(req.txid) == 12
    else:
        ip, port = stun.parse_success(data[1:], data[9:21])
        assert 0 <= port < 65536 and ip


def webrtc_signal_messages(data: bytes) -> None:
    """The signalling protocol's offer and answer parsers over its declared limits.
    Layout: [which parser] stream."""
    if not data:
        return
    for env in _events(webrtc_signal.LIMITS.decoder(), [data[1:]]):
        assert isinstance(env, Envelope)
        sdp = (webrtc_signal.parse_offer(env) if data[0] % 2 == 0
               else webrtc_signal.parse_answer(env, env.id))
        assert len(sdp.encode()) <= webrtc_signal.MAX_SDP


TARGETS: Final[dict[str, tuple[Callable[[bytes], None],
                               tuple[type[BaseException], ...]]]] = {
    "wire": (wire_frames, (RemoteProtocolError,)),
    "averaging": (averaging_exchange, (RemoteProtocolError,)),
    "pipe": (pipe_stream, (RemoteProtocolError,)),
    "codecs": (codecs_decode, (RemoteProtocolError,)),
    "manifest_toml": (manifest_toml, (mf.ManifestError,)),
    "manifest_canonical": (manifest_canonical, (mf.ManifestError,)),
    "exchanges": (exchange_messages, (RemoteProtocolError, LookupError, mf.ManifestError)),
    "rundoc": (rundoc_merge, (RemoteProtocolError,)),
    "heartbeat": (heartbeat_decode, (RemoteProtocolError,)),
    "records": (records_decode, (RemoteProtocolError,)),
    "history": (history_decode, (RemoteProtocolError,)),
    "checkpoint": (checkpoint_manifest, (RemoteProtocolError,)),
    "lane": (lane_records, (RemoteProtocolError,)),
    "keys": (peer_ids, (RemoteProtocolError,)),
    "stun": (stun_messages, (RemoteProtocolError,)),
    "webrtc_signal": (webrtc_signal_messages, (RemoteProtocolError, LookupError)),
}


def run(name: str, data: bytes) -> None:
    """One execution of target `name`: a documented refusal is swallowed, anything else
    propagates (the fuzzer reports it as a crash)."""
    target, refusals = TARGETS[name]
    with contextlib.suppress(*refusals):
        target(data)


# --- seeds: valid inputs, so the fuzzer starts past the first checks -----------------------


def seeds(name: str) -> list[bytes]:
    """A few valid inputs for target `name` (FDP-configured targets: the FDP consumes
    its config from the end of the input, so seeds are only a good start, not exact)."""
    vec = torch.linspace(-1, 1, 40)
    if name in ("wire", "averaging"):
        a = av.Exchange("initiator", RUN, 3, 40, ["int8", "fp32"], chunk_elems=16)
        b = av.Exchange("responder", RUN, None, None, codecs.CODECS)
        offer = a.initiate()
        b.receive_data(offer)
        b.next_event()
        a.receive_data(b.accept("int8"))
        a.next_event()
        stream = offer + b"".join(bytes(p) for p in a.send_vector(vec))
        raw = make_tensor_header("w", "float32", [4], "raw", bytes(16))
        tensor = b"".join(bytes(p) for p in encode_tensor_frame(raw, bytes(16)))
        if name == "averaging":
            return [bytes([255]) + stream, bytes([3]) + stream]
        request = mx.encode_request(1, RUN)  # config 0: avg, 2: request; 4: in place
        return [bytes([0, 255]) + stream, bytes([4, 7]) + stream, bytes([8, 255]) + tensor,
                bytes([2, 30]) + request]
    if name == "pipe":
        x = torch.linspace(-1, 1, 2 * 3 * 8).reshape(2, 3, 8)
        stream = b"".join(bytes(p) for k in ("act", "grad")
                          for p in pipe.encode(k, RUN, 2, 5, 1, x))
        return [bytes([255]) + stream, bytes([3]) + stream]
    if name == "codecs":
        return [codec_config(c, 40) + bytes(codecs.encode(vec, c).payload)
                for c in codecs.CODECS]
    if name in ("manifest_toml", "manifest_canonical"):
        text = (REPO / "testnet" / "default_manifest.toml").read_bytes()
        return [text, mf.canonical_bytes(mf.parse_manifest(text))]
    if name == "exchanges":
        canonical = mf.canonical_bytes(mf.parse_manifest(
            (REPO / "testnet" / "default_manifest.toml").read_bytes()))
        return [
            b"\0" + mx.encode_request(1, RUN),
            b"\1" + mx.encode_response(1, RUN, canonical),
            b"\1" + mx.encode_error(1, "unknown-run", "no"),
            b"\2" + cx.request_chunk(2, "Qm" + "a" * 44, 3),
            b"\3" + cx.respond(Envelope("ckpt.chunk", 2, {"cid": "Qm"}), b"data", 3),
        ]
    if name == "rundoc":
        doc = rundoc.RunDocument(RUN, SIGNER, [SIGNER.peer_id])
        delta = doc.set(f"peer/{SIGNER.peer_id}/addrs", ["/ip4/1.2.3.4"], 1_700_000_000_000)
        doc.set("run/lr", 0.1, 1_700_000_000_001)
        return [b"\0" + delta, b"\1" + doc.summary(), b"\2" + doc.to_bytes(), delta]
    if name == "heartbeat":
        return [heartbeat.Heartbeat(SIGNER.peer_id, 7, ("/ip4/1.2.3.4/tcp/1",),
                                    stats={"step": 3, "loss": 0.5}).encode()]
    if name == "records":
        return [records.encode(SIGNER, 5, ["/ip4/1.2.3.4/tcp/1"], [RUN])]
    if name == "history":
        return [history.encode_history(OTHER, RUN, SIGNER.peer_id, 4, 1,
                                       torch.arange(HISTORY_LEN, dtype=torch.float32))]
    if name == "checkpoint":
        data = bytes(200_000)
        return [checkpoint.build(RUN, 3, 1, data, {"loss": 0.5}, chunk=1 << 16).encode()]
    if name == "lane":
        sealer = lane.Sealer(bytes(32), 0)
        return [sealer.seal(b"hello lane")]
    if name == "keys":
        return [SIGNER.sign(b"x") + SIGNER.peer_id.encode()]
    if name == "stun":
        txid = bytes(range(12))
        success = stun.encode_success(txid, "198.18.1.2", 4001)
        return [b"\0" + stun.encode_request(txid, stun.CHANGE_IP), b"\1" + success]
    if name == "webrtc_signal":
        sdp = ("v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n"
               "m=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n")
        return [b"\0" + webrtc_signal.encode_offer(1, sdp),
                b"\1" + webrtc_signal.encode_answer(2, sdp),
                b"\1" + webrtc_signal.encode_error(3, "busy", "16 sessions open")]
    raise KeyError(name)


def all_seeds() -> dict[str, list[bytes]]:
    return {name: seeds(name) for name in TARGETS}
