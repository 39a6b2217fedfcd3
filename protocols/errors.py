"""The two ways a protocol exchange goes wrong (after h11).

`RemoteProtocolError`: the peer sent something we refuse (malformed, oversized, forged,
unknown version). The caller logs the reason, closes that stream, and carries on.
`LocalProtocolError`: we misused the API; it is a bug in peertrain, not in the peer.
"""


class ProtocolError(Exception):
    """Base class of every error raised by protocols/."""


class RemoteProtocolError(ProtocolError):
    """The remote peer violated the protocol; the message says how."""


class LocalProtocolError(ProtocolError):
    """This side misused a protocol object (a programming error)."""
