"""A node's persistent Ed25519 identity: one key file in the state directory, mode 0600.

Losing the file loses nothing but the node's name (its peer id); keeping it means a node
that restarts comes back as the same peer, so others' peer books and DHT provider records
stay valid.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.identity_utils import load_identity, save_identity
from libp2p.peer.id import ID

log = logging.getLogger(__name__)

KEY_FILE = "identity.key"


class IdentityError(Exception):
    """The identity file exists but cannot be used; the message says how to fix it."""


def load_or_create_identity(state_dir: Path) -> KeyPair:
    """Load `state_dir/identity.key`, creating it (0600) on first start."""
    path = Path(state_dir) / KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        key_pair = create_new_key_pair()
        save_identity(key_pair, path)  # writes with mode 0600
        log.info("created identity %s in %s", ID.from_pubkey(key_pair.public_key), path)
        return key_pair
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        # Same stance as ssh: a private key others can read is fixed, loudly.
        log.warning("identity file %s had mode %o; tightening to 0600", path, mode)
        os.chmod(path, 0o600)
    try:
        key_pair = load_identity(path)
    except (ValueError, OSError) as e:
        raise IdentityError(
            f"cannot read the node identity {path}: {e}. Move it away to start as a new peer."
        ) from e
    if key_pair.private_key.get_type() != KeyType.Ed25519:
        raise IdentityError(f"{path} holds a {key_pair.private_key.get_type().name} key; "
                            "peertrain identities are Ed25519")
    return key_pair



def peer_id_of(key_pair: KeyPair) -> str:
    return ID.from_pubkey(key_pair.public_key).to_base58()
