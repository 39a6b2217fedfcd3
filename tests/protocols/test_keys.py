"""protocols/keys.py against py-libp2p's own peer ids and signatures."""

import base58
import pytest
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import Ed25519PublicKey, create_new_key_pair
from libp2p.peer.id import ID

from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.keys import (
    Signer,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify,
)


@pytest.mark.parametrize("_", range(5))
def test_peer_id_matches_libp2p(_):
    kp = create_new_key_pair()
    raw = kp.public_key.to_bytes()
    ours = peer_id_from_public_key(raw)
    assert ours == ID.from_pubkey(kp.public_key).to_base58()
    assert ours.startswith("12D3KooW")
    assert public_key_from_peer_id(ours) == raw


def test_signer_from_libp2p_keypair():
    kp = create_new_key_pair()
    seed = kp.private_key.to_bytes()
    assert len(seed) == 32  # py-libp2p's to_bytes() is the seed; go-libp2p's is seed || pub
    signer = Signer(seed[:32])
    assert signer.peer_id == ID.from_pubkey(kp.public_key).to_base58()
    assert signer.public_key == kp.public_key.to_bytes()
    msg = b"the run document"
    assert signer.sign(msg) == kp.private_key.sign(msg)  # Ed25519 is deterministic


def test_signatures_interoperate():
    kp = create_new_key_pair()
    pid = ID.from_pubkey(kp.public_key).to_base58()
    sig = kp.private_key.sign(b"hello")
    assert verify(pid, b"hello", sig)
    assert not verify(pid, b"hellO", sig)
    assert not verify(pid, b"hello", sig[:-1] + bytes([sig[-1] ^ 1]))
    assert not verify(pid, b"hello", sig[:63])
    other = Signer.generate()
    assert not verify(other.peer_id, b"hello", sig)
    ours = other.sign(b"hello")
    assert Ed25519PublicKey.from_bytes(other.public_key).verify(b"hello", ours)


@given(st.binary(min_size=32, max_size=32))
def test_round_trip_any_key(raw):
    assert public_key_from_peer_id(peer_id_from_public_key(raw)) == raw


@pytest.mark.parametrize(
    ("peer_id", "words"),
    [
        ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "sha2-256"),
        ("16Uiu2HAmLhLvBoYaoZfaMUKuibM6ac163GwKY74c5kiSLg5KvLpY", "secp256k1"),
        ("0OIl", "base58"),
        ("", "malformed"),
        ("1" * 200, "malformed"),
        ("12D3KooW", "not an Ed25519"),
    ],
)
def test_rejects_non_ed25519_ids(peer_id, words):
    with pytest.raises(RemoteProtocolError, match=words):
        public_key_from_peer_id(peer_id)
    with pytest.raises(RemoteProtocolError):
        verify(peer_id, b"x", bytes(64))


def test_rejects_truncated_and_padded_ids():
    pid = Signer.generate().peer_id
    raw = base58.b58decode(pid)
    for bad in (raw[:-1], raw + b"\x00"):
        with pytest.raises(RemoteProtocolError):
            public_key_from_peer_id(base58.b58encode(bad).decode())


def test_local_misuse():
    with pytest.raises(LocalProtocolError):
        peer_id_from_public_key(b"short")
    with pytest.raises(LocalProtocolError):
        Signer(b"\x00" * 31)
