"""protocols/history.py: signed SybilWall history entries, and everything a peer may forge."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import history as hp
from protocols.keys import Signer

RUN = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"
N = 100
LIMIT = 4 * N + 4096


def decode(data: bytes, **kw) -> hp.SignedHistory:
    return hp.decode_history(data, **{"run_id": RUN, "expected_len": N, "max_bytes": LIMIT,
                                      **kw})


def test_round_trip_and_forwarding_keeps_the_observers_signature():
    observer = Signer.generate()
    vector = torch.linspace(-1, 1, N)
    msg = decode(hp.encode_history(observer, RUN, "subject-peer", 7, 1, vector))
    assert (msg.subject, msg.observer, msg.round, msg.distance) == (
        "subject-peer", observer.peer_id, 7, 1)
    assert torch.equal(msg.vector, vector)
    forwarded = decode(hp.forward_history(msg, 3))
    assert forwarded.distance == 3 and forwarded.observer == observer.peer_id
    assert torch.equal(forwarded.vector, vector)


def tamper(data: bytes, **changes) -> bytes:
    doc = msgpack.unpackb(data)
    doc.update(changes)
    return msgpack.packb(doc)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"round": 8}, "bad signature"),                      # a replayed entry with a new round
    ({"subject": "someone-else"}, "bad signature"),       # moved to another peer
    ({"vector": b"\0" * (4 * N)}, "bad signature"),       # a different history
    ({"observer": Signer.generate().peer_id}, "bad signature"),  # in another peer's name
    ({"run": "QmOther"}, "another run"),
    ({"vector": b"\0" * 8}, "values take"),
    ({"round": -1}, "round must be"),
    ({"distance": "far"}, "distance must be"),
    ({"sig": b"short"}, "64 bytes"),
    ({"v": 2}, "version-1"),
])
def test_forged_and_malformed_entries_are_refused(changes, reason):
    data = hp.encode_history(Signer.generate(), RUN, "subject", 7, 1, torch.ones(N))
    with pytest.raises(hp.HistoryError, match=reason):
        decode(tamper(data, **changes))


def test_distance_is_not_signed_so_a_forwarder_can_set_it():
    data = hp.encode_history(Signer.generate(), RUN, "subject", 7, 1, torch.ones(N))
    assert decode(tamper(data, distance=2)).distance == 2  # bounded by the table instead


def test_nan_vectors_and_oversized_messages_are_refused_before_use():
    signer = Signer.generate()
    nan = torch.ones(N)
    nan[3] = float("nan")
    with pytest.raises(hp.HistoryError, match="NaN"):
        decode(hp.encode_history(signer, RUN, "s", 1, 1, nan))
    big = hp.encode_history(signer, RUN, "s", 1, 1, torch.ones(20 * N))
    with pytest.raises(hp.HistoryError, match="exceeds"):
        decode(big)
    with pytest.raises(hp.HistoryError, match=r"malformed|values take"):  # wrong length
        decode(big, max_bytes=20 * LIMIT)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_garbage_never_gets_past_decode(data):
    with pytest.raises(hp.HistoryError):
        decode(data)


def test_truncated_messages_are_refused():
    data = hp.encode_history(Signer.generate(), RUN, "s", 1, 1, torch.ones(N))
    for cut in (1, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(hp.HistoryError):
            decode(data[:cut])
