"""The daemon: composes p2p/, protocols/ and the torch trainer."""
