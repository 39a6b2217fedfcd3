"""The redialer (node/membership/redial.py) against a fake host: whom it dials, and how it
backs off.

The backoff runs on trio's clock; these tests let it pass with pytest-trio's
`autojump_clock` (a sleep returns at once, the clock jumps), not by editing its tables."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.membership.redial import Redialer, dial_partner
from p2p.host import DialError


def peer_addr(port: int) -> tuple[str, str]:
    pid = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
    return pid, f"/ip4/127.0.0.1/tcp/{port}/p2p/{pid}"


class FakeHost:
    """Just what the redialer uses: who we are, who we are connected to, and dialing."""

    def __init__(self, reachable: set[str]) -> None:
        self.peer_id = ID.from_pubkey(create_new_key_pair().public_key)
        self.reachable = reachable
        self.connected: set[str] = set()
        self.dialed: list[str] = []
        self.dht = None

    def connected_peers(self) -> list[ID]:
        return [ID.from_base58(p) for p in self.connected]

    async def connect(self, addr: str, timeout: float = 10.0) -> ID:
        peer = addr.rsplit("/", 1)[1]
        self.dialed.append(peer)
        if peer not in self.reachable:
            raise DialError(addr, "Network is unreachable")
        self.connected.add(peer)
        return ID.from_base58(peer)


def backs_off(r: Redialer, peer: str, wait: float) -> bool:
    """`peer` is tried again in `wait` seconds less up to 20% jitter (statistics() rounds
    to 0.1 s)."""
    left = r.statistics()["backing_off"][peer]  # type: ignore[index]
    return 0.8 * wait - 0.05 <= left <= wait + 0.05


async def test_bootstrap_always_members_while_few_connections_and_backoff_is_capped(
    autojump_clock,
):
    boot, boot_addr = peer_addr(1)
    a, a_addr = peer_addr(2)
    b, b_addr = peer_addr(3)
    host = FakeHost(reachable={a})
    members = {a: [a_addr], b: [b_addr], host.peer_id.to_base58(): ["/ignored"]}
    r = Redialer(host, [boot_addr], lambda: members, backoff_min_s=1.0, backoff_max_s=8.0)

    assert await r.tick() == 1  # a is reached; the bootstrap and b are not
    assert set(host.dialed) == {boot, a, b} and host.connected == {a}
    assert backs_off(r, b, r.backoff_min_s)
    host.dialed.clear()
    await r.tick()
    assert host.dialed == []  # nobody is due before their backoff has passed
    last = r.backoff_min_s
    for wait in [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]:  # doubling, capped
        await trio.sleep(last)  # the clock jumps: both failed peers are due again
        host.dialed.clear()
        await r.tick()
        assert set(host.dialed) == {boot, b}  # never a (connected) nor ourselves
        assert backs_off(r, b, wait)
        last = wait
    assert r.statistics()["redials"] == 1 and r.statistics()["failures"] == 14

    # The partition heals: the next due try reaches them and resets their backoff.
    host.reachable |= {boot, b}
    await trio.sleep(r.backoff_max_s)
    assert await r.tick() == 2
    assert b not in r._backoff and host.connected == {a, b, boot}


async def test_with_enough_connections_only_one_member_is_probed_per_period(autojump_clock):
    members = dict(peer_addr(10 + i) for i in range(5))
    host = FakeHost(reachable=set())
    host.connected = {peer_addr(20 + i)[0] for i in range(3)}
    r = Redialer(host, [], lambda: {p: [a] for p, a in members.items()}, want_peers=3, probe_s=10.0)
    await r.tick()
    assert len(host.dialed) == 1  # one random probe, not all five
    await trio.sleep(r.backoff_max_s)  # the probed peer's backoff is over; probe_s is not
    host.dialed.clear()
    await r.tick()
    assert host.dialed == []  # the next probe waits for probe_s
    await trio.sleep(r.probe_s - r.backoff_max_s)
    await r.tick()
    assert len(host.dialed) == 1


async def test_malformed_member_addresses_are_skipped():
    good, good_addr = peer_addr(30)
    host = FakeHost(reachable={good})
    members = {good: [good_addr], "12D3KooWbad": 42, "12D3KooWworse": [1, 2]}
    r = Redialer(host, [], lambda: members)  # type: ignore[arg-type]
    assert await r.tick() == 1 and host.dialed == [good]


# -- the connection bound (issue 30): plan_connections and the redialer that follows it --

import random  # noqa: E402

from node.membership.redial import plan_connections  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(n_members=st.integers(0, 2000), n_connected=st.integers(0, 200),
       want=st.integers(0, 40), extra=st.integers(0, 40), seed=st.integers(0, 2**32 - 1),
       probe=st.booleans())
def test_the_plan_never_dials_past_the_deficit_nor_keeps_past_the_cap(
        n_members, n_connected, want, extra, seed, probe):
    members = {f"m{i}": ["/a"] for i in range(n_members)}
    connected = {f"m{i}" for i in range(0, min(n_members, n_connected))} | {
        f"x{i}" for i in range(max(0, n_connected - n_members))}
    live = {f"m{i}" for i in range(0, n_members, 3)}
    protected = {p for p in sorted(connected)[:5]}
    dial, close = plan_connections(connected, members, want=want, max_peers=want + extra,
                                   rng=random.Random(seed), live=live, protected=protected,
                                   probe=probe)
    assert not set(dial) & connected and set(dial) <= set(members)
    assert len(dial) == len(set(dial)) <= max(want - len(connected), 1 if probe else 0)
    if len(connected) < want:  # everybody it could dial, up to the deficit
        assert len(dial) == min(want - len(connected), n_members - len(connected & set(members)))
        unconnected_live = live - connected
        assert set(dial) >= unconnected_live or set(dial) <= unconnected_live  # live first
    assert set(close) <= connected - protected and len(close) == len(set(close))
    assert len(connected) - len(close) <= max(want + extra, len(protected & connected))
    if len(connected) <= want + extra:
        assert close == []
    # the same seed, the same plan: the simulator replays it
    assert (dial, close) == plan_connections(connected, members, want=want,
                                             max_peers=want + extra, rng=random.Random(seed),
                                             live=live, protected=protected, probe=probe)


def test_the_plan_refuses_a_cap_below_want():
    with pytest.raises(ValueError):
        plan_connections([], {}, want=8, max_peers=4, rng=random.Random(0))


class ClosingHost(FakeHost):
    def __init__(self, reachable: set[str]) -> None:
        super().__init__(reachable)
        self.closed: list[str] = []

    async def disconnect(self, peer: ID) -> None:
        self.closed.append(peer.to_base58())
        self.connected.discard(peer.to_base58())


async def test_a_run_of_a_thousand_members_costs_want_peers_dials_not_a_thousand(
        autojump_clock):
    members = dict(peer_addr(1000 + i) for i in range(1000))
    host = ClosingHost(reachable=set(members))
    live = sorted(members)[:100]
    r = Redialer(host, [], lambda: {p: [a] for p, a in members.items()}, want_peers=8,
                 max_peers=16, live=lambda: live, rng=random.Random(1))
    assert await r.tick() == 8
    assert len(host.dialed) == 8 and set(host.dialed) <= set(live)  # live members first
    host.dialed.clear()
    await r.tick()
    assert len(host.dialed) == 1  # enough: only the probe (the first at once)
    await r.tick()
    assert len(host.dialed) == 1  # ... then one every probe_s
    await trio.sleep(r.probe_s)
    await r.tick()
    assert len(host.dialed) == 2
    assert len(host.connected) == 10


async def test_past_max_peers_the_oldest_unprotected_connections_are_closed(autojump_clock):
    boot, boot_addr = peer_addr(1)
    others = [peer_addr(2000 + i)[0] for i in range(40)]
    host = ClosingHost(reachable=set())
    host.connected = {boot, *others}
    keep = others[0]
    r = Redialer(host, [boot_addr], lambda: {}, want_peers=8, max_peers=16, grace_s=60.0,
                 live=lambda: others[:10], protect=lambda: {keep}, rng=random.Random(2))
    await r.tick()
    assert host.closed == []  # all of them are young: within the grace period
    await trio.sleep(61.0)
    await r.tick()
    assert len(host.connected) == 16 and len(host.closed) == 25
    assert boot in host.connected and keep in host.connected
    # peers that are not live members went first: the 10 live ones all stay
    assert len(set(others[:10]) & host.connected) == 10
    assert r.statistics()["closed_over_max"] == 25


@settings(max_examples=40, deadline=None)
@given(reachable_at=st.integers(-1, 6), n_addrs=st.integers(0, 6), tries=st.integers(1, 4))
def test_a_partner_is_dialed_on_demand_at_most_tries_addresses(reachable_at, n_addrs, tries):
    """Partners come from the whole live view (issue 30), most of them not connected: the
    initiator dials one at the addresses the view has for it, at most `tries` of them,
    stopping at the first that answers; a connected partner costs no dial."""
    partner, _ = peer_addr(9)
    host = FakeHost(reachable=set())
    tried: list[str] = []

    async def connect(addr: str, timeout: float = 10.0) -> ID:
        tried.append(addr)
        if len(tried) - 1 == reachable_at:
            host.connected.add(partner)
            return ID.from_base58(partner)
        raise DialError(addr, "Connection refused")

    host.connect = connect  # type: ignore[method-assign]
    addrs = [f"/ip4/10.0.0.{i}/tcp/1" for i in range(n_addrs)]
    ok = trio.run(lambda: dial_partner(host, partner, addrs, tries=tries))
    assert len(tried) <= min(tries, n_addrs)
    assert all(a.endswith(f"/p2p/{partner}") for a in tried)
    assert ok == (0 <= reachable_at < min(tries, n_addrs))
    tried.clear()
    if ok:  # connected now: the next round's dial is free
        assert trio.run(lambda: dial_partner(host, partner, addrs, tries=tries))
        assert tried == []
