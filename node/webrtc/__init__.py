"""WebRTC data channels (aiortc): the last-resort path between peers that reach each other
only over UDP (docs/nat.md, "WebRTC")."""

#: The path kind `node status` shows for a peer reached over a WebRTC data channel.
PATH_WEBRTC = "webrtc"


class SessionError(Exception):
    """A WebRTC session could not be set up or was lost; the message says where."""
