"""How bytes reach a peer: libp2p streams with deadlines (streams.py) and the lane, our
own framed TCP path for large tensors (lane.py). The services open streams through these,
never through py-libp2p directly."""
