"""Application protocols as sans-IO cores: bytes in, bytes and events out. Never imports trio or libp2p."""
