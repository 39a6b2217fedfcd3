"""py-libp2p's ERROR records come under the per-peer log limits (node/status/logs.py).

Seen: "protocols not supported", "Unexpected error opening TCP stream" and stop-handler
errors, 14-62 per node per run, each written whole: they carry no peer or reason, so the
flood filter let every one through."""

from __future__ import annotations

import logging

from node.status.logs import PeerFlood
from tests.node.status.test_log_flood import Collect

PEER_A = "12D3KooW" + "A" * 44  # 52 characters, as a real one
PEER_B = "12D3KooW" + "B" * 44


def _libp2p(msg: str, args: tuple, t: float, name: str = "libp2p.host.basic_host"):
    r = logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)
    r.created = t
    return r


def test_libp2p_errors_are_cut_to_a_burst_per_peer_and_kind():
    flood, out = PeerFlood(burst=3, window_s=60), Collect()
    out.addFilter(flood)
    for i in range(40):  # one peer, one kind of failure, a different stream each time
        out.handle(_libp2p(f"stream {i}: protocols not supported by {PEER_A}", (), 100 + i))
    for i in range(40):  # formatted by logging: one kind, whatever the address
        out.handle(_libp2p("Unexpected error opening TCP stream: %s",
                           (f"connect to 10.0.0.{i}:{4000 + i} failed",), 100 + i,
                           "libp2p.transport.tcp.tcp"))
    out.handle(_libp2p(f"stream 1: protocols not supported by {PEER_B}", (), 150))
    assert len(out.lines) == 3 + 3 + 1
    assert flood.statistics()["suppressed"] == {"libp2p": 74}  # one bounded label


def test_the_key_blanks_what_varies():
    from node.status.logs import third_party_key

    a = third_party_key(_libp2p(f"stream 7 to {PEER_A} at /ip4/1.2.3.4/tcp/9: reset", (), 1))
    b = third_party_key(_libp2p(f"stream 9 to {PEER_A} at /ip4/5.6.7.8/tcp/1: reset", (), 2))
    assert a == b and a[0] == PEER_A


def test_routine_errors_are_left_to_the_file_filter():
    flood = PeerFlood(burst=1)
    for i in range(5):
        r = _libp2p("Failed to open TCP stream: %s", (f"x{i}",), 10 + i,
                    "libp2p.transport.tcp.tcp")
        assert flood.filter(r)  # node.log's own filter drops these, with no summary
    assert flood.statistics()["suppressed"] == {}
