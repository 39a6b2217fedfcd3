"""The resource budget's admission checks (p2p/budget.py)."""

from __future__ import annotations

from p2p.budget import Budget, BudgetLimits, subnet_of


def test_streams_per_peer_per_protocol_and_in_all():
    b = Budget(BudgetLimits(streams_per_peer=3, streams_per_peer_protocol=2, streams_total=4))
    assert [b.admit_stream("a") for _ in range(4)] == [None, None, None, "streams_per_peer"]
    assert b.admit_stream("b") is None
    assert b.admit_stream("c") == "streams_total"
    assert [b.admit_protocol("a", "/p") for _ in range(3)] == [None, None,
                                                               "streams_per_peer_protocol"]
    assert b.admit_protocol("a", "/q") is None  # another protocol has its own count
    b.release_protocol("a", "/p")
    assert b.admit_protocol("a", "/p") is None
    b.release_stream("a")
    assert b.admit_stream("c") is None
    assert b.refused == {"streams_per_peer": 1, "streams_total": 1,
                         "streams_per_peer_protocol": 1}


def test_bytes_in_flight():
    b = Budget(BudgetLimits(bytes_per_peer=100, bytes_total=1000))
    assert b.admit_stream("a", peer_bytes=101) == "bytes_per_peer"
    assert b.admit_stream("a", peer_bytes=50, total_bytes=1001) == "bytes_total"
    assert b.admit_stream("a", peer_bytes=50, total_bytes=500) is None


def test_connections_per_ip_and_range():
    b = Budget(BudgetLimits(conns_per_ip=2, conns_per_subnet=3))
    assert [b.admit_connection("10.0.0.1") for _ in range(3)] == [None, None, "conns_per_ip"]
    assert b.admit_connection("10.0.0.2") is None
    assert b.admit_connection("10.0.0.3") == "conns_per_subnet"
    assert b.admit_connection("10.0.1.3") is None  # another /24
    b.release_connection("10.0.0.1")
    assert b.admit_connection("10.0.0.3") is None


def test_default_lets_a_loopback_testnet_be():
    b = Budget()
    assert all(b.admit_connection("127.0.0.1") is None for _ in range(100))


def test_subnets():
    assert subnet_of("192.168.7.9") == "192.168.7.0/24"
    assert subnet_of("2001:db8:1:2::5") == "2001:db8:1::/48"
    assert subnet_of("not an ip") == "not an ip"
