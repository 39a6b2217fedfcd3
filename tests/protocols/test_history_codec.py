"""protocols/history.py: signed SybilWall history entries, and everything a peer may forge."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import history as hp
from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.keys import Signer

RUN = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"
N = 100
LIMIT = hp.max_message_bytes(N)
OBSERVER = Signer(bytes(range(32)))
SUBJECT = Signer(bytes(range(1, 33))).peer_id


def decode(data: bytes, **kw) -> hp.SignedHistory:
    return hp.decode_history(data, **{"run_id": RUN, "expected_len": N, "max_bytes": LIMIT, **kw})


def encoded(vector: torch.Tensor | None = None, **kw) -> bytes:
    args = {"run": RUN, "subject": SUBJECT, "round": 7, "distance": 1, **kw}
    return hp.encode_history(OBSERVER, vector=torch.ones(N) if vector is None else vector, **args)


def tamper(data: bytes, **changes) -> bytes:
    doc = msgpack.unpackb(data)
    doc.update(changes)
    return msgpack.packb(doc)


def test_round_trip_and_forwarding_keeps_the_observers_signature():
    vector = torch.linspace(-1, 1, N)
    data = encoded(vector)
    assert len(data) <= LIMIT
    msg = decode(data)
    assert (msg.run, msg.subject, msg.observer, msg.round, msg.distance) == (
        RUN,
        SUBJECT,
        OBSERVER.peer_id,
        7,
        1,
    )
    assert msg.vector.dtype == torch.float32 and torch.equal(msg.vector, vector)
    msg.vector[0] = 5.0  # ours to keep: a writable copy, not a view of the message
    forwarded = decode(hp.forward_history(decode(data), 3))
    assert forwarded.distance == 3 and forwarded.observer == OBSERVER.peer_id
    assert torch.equal(forwarded.vector, vector)


def test_the_wire_form_is_the_documented_map_with_a_little_endian_vector():
    vector = torch.tensor([1.0, -2.5] + [0.0] * (N - 2))
    doc = msgpack.unpackb(encoded(vector))
    assert set(doc) == {"v", "run", "subject", "observer", "round", "distance", "vector", "sig"}
    assert doc["v"] == 1 and doc["vector"][:8] == b"\x00\x00\x80\x3f\x00\x00\x20\xc0"
    # The signature covers sha256 of exactly those bytes.
    signed = msgpack.packb(
        ["peertrain-history-v1", RUN, SUBJECT, OBSERVER.peer_id, 7,
         hashlib.sha256(doc["vector"]).digest()]
    )  # fmt: skip
    assert OBSERVER.sign(signed) == doc["sig"]


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"round": 8}, "bad signature"),  # a replayed entry with a new round
        ({"subject": Signer(bytes(32)).peer_id}, "bad signature"),  # moved to another peer
        ({"vector": b"\0" * (4 * N)}, "bad signature"),  # a different history
        ({"observer": Signer(bytes(32)).peer_id}, "bad signature"),  # in another's name
        ({"sig": b"\0" * 64}, "bad signature"),
        ({"run": "QmOther"}, "another run"),
        ({"vector": b"\0" * 8}, "values take"),
        ({"vector": "text"}, "a str"),
        ({"round": -1}, "round must be"),
        ({"round": 2**64 - 1}, "round must be"),
        ({"round": 7.0}, "round must be"),
        ({"distance": "far"}, "distance must be"),
        ({"distance": 0}, "distance must be"),
        ({"sig": b"short"}, "64 bytes"),
        ({"v": 2}, "unknown history message version 2"),
        ({"v": True}, "unknown history message version True"),
        ({"run": ""}, "non-empty strings"),
        ({"subject": 5}, "non-empty strings"),
        ({"observer": "QmNotAnEd25519Key"}, "observer: peer id"),
        ({"subject": OBSERVER.peer_id}, "observer is its own subject"),
    ],
)
def test_forged_and_malformed_entries_are_refused(changes, reason):
    with pytest.raises(hp.HistoryError, match=reason):
        decode(tamper(encoded(), **changes))


def test_distance_is_not_signed_so_a_forwarder_can_set_it():
    assert decode(tamper(encoded(), distance=2)).distance == 2  # bounded by the table instead


def test_wrong_run_id_is_refused():
    with pytest.raises(hp.HistoryError, match="another run"):
        decode(encoded(), run_id="QmSomeOtherRun")


def test_nan_and_inf_vectors_are_refused():
    for bad in (float("nan"), float("inf"), float("-inf")):
        vector = torch.ones(N)
        vector[3] = bad
        raw = vector.numpy().astype("<f4").tobytes()
        # Signed honestly by a careless observer: the values are still refused.
        digest = hashlib.sha256(raw).digest()
        signed = msgpack.packb(["peertrain-history-v1", RUN, SUBJECT, OBSERVER.peer_id, 7, digest])
        data = tamper(encoded(), vector=raw, sig=OBSERVER.sign(signed))
        with pytest.raises(hp.HistoryError, match="NaN or Inf"):
            decode(data)


def test_oversized_messages_are_refused_before_unpacking():
    big = encoded(torch.ones(20 * N))
    with pytest.raises(hp.HistoryError, match=f"{len(big)} bytes exceeds {LIMIT}"):
        decode(big)
    # Not even msgpack is consulted: an oversized message of garbage says the same.
    with pytest.raises(hp.HistoryError, match="exceeds"):
        decode(b"\xc1" * (LIMIT + 1))
    # Under the size cap, a vector of the wrong length is refused by msgpack's own limit on
    # byte strings, or by the length check: never turned into a tensor.
    with pytest.raises(hp.HistoryError, match=r"malformed|values take"):
        decode(big, max_bytes=len(big))
    short = encoded(torch.ones(N - 1))
    with pytest.raises(hp.HistoryError, match="396 bytes; 100 values take 400"):
        decode(short)


def test_a_huge_claimed_length_allocates_nothing():
    """bin32 header claiming 4 GiB, map32 claiming 4 billion entries: refused at once."""
    for data in (b"\xc6\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff"):
        with pytest.raises(hp.HistoryError, match="malformed"):
            decode(data)


def test_truncated_messages_are_refused():
    data = encoded()
    for cut in range(0, len(data)):
        with pytest.raises(hp.HistoryError):
            decode(data[:cut])
    with pytest.raises(hp.HistoryError, match="malformed"):
        decode(data + b"\x00")  # trailing bytes


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_garbage_never_gets_past_decode(data):
    with pytest.raises(hp.HistoryError):
        decode(data)


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.binary(max_size=500),
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["v", "run", "subject", "observer", "round", "distance", "vector", "sig"]),
        _values,
    )
)
def test_structured_garbage_is_refused_with_a_history_error(doc):
    """Maps with the right keys and wrong values: HistoryError, never anything else."""
    with pytest.raises(hp.HistoryError):
        decode(msgpack.packb(doc))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**63 - 1), st.integers(1, 2**63 - 1), st.integers(0, 4096))
def test_any_honest_entry_round_trips(round, distance, seed):
    vector = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    msg = decode(encoded(vector, round=round, distance=distance))
    assert (msg.round, msg.distance) == (round, distance) and torch.equal(msg.vector, vector)


def test_history_error_is_a_remote_error_and_encoding_mistakes_are_local():
    assert issubclass(hp.HistoryError, RemoteProtocolError)
    nan = torch.ones(N)
    nan[0] = float("nan")
    with pytest.raises(LocalProtocolError, match="NaN"):
        encoded(nan)
    with pytest.raises(LocalProtocolError, match="own history"):
        encoded(subject=OBSERVER.peer_id)
    with pytest.raises(LocalProtocolError, match="distance"):
        encoded(distance=0)
