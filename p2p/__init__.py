"""Networking substrate on py-libp2p: host, identity, DHT, pubsub. Never imports torch."""
