"""Application protocols as sans-IO cores: bytes in, bytes and events out. No trio, no libp2p."""
