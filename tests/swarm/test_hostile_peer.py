"""A hostile peer against a real training node: every protocol the node serves (its
identify answer lists them) gets idle streams, huge announced sizes, truncated frames and
junk floods, and the gossip topics get ~1 MB junk messages. The node must stay small (peak
RSS), answer `node status` within 1 s throughout, keep training, and end up banning the
peer (docs/robustness.md, budgets).

Every attack loop is bounded in count and time; the test waits on conditions with
deadlines, never on sleeps."""

from __future__ import annotations

import contextlib
import os
import struct
import time
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12 as GOSSIP_12

from node.run.rundoc_sync import PROTOCOL_ID as META_ID
from node.run.rundoc_sync import topic as meta_topic
from node.status.control import query_control
from p2p.dht import DHT_PROTOCOL
from p2p.host import Substrate
from protocols import averaging as av
from protocols import ckpt_exchange as cx
from protocols import heartbeat as hb
from protocols import manifest_exchange as mx
from testnet import launcher
from tests.conftest import await_until, nodes, status, training, wait_until

pytestmark = pytest.mark.slow

# What a training node serves at least: ours, the DHT's, gossipsub's, identify and ping.
# The attack covers every protocol the node lists in its identify answer (so a protocol
# added later is attacked too); these must be among them.
PROTOCOLS = [mx.PROTOCOL_ID, cx.PROTOCOL_ID, META_ID, av.PROTOCOL_ID, str(DHT_PROTOCOL),
             str(GOSSIP_12), "/ipfs/id/1.0.0", "/ipfs/ping/1.0.0"]
IDLE_PER_PROTOCOL = 24  # above the per-peer, per-protocol budget (16)
BAD_FRAMES_PER_KIND = 4
ATTACK_S = 90  # no loop runs past this, whatever happens
MIB = 1 << 20


def memory_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0])
    return fields


def payloads(protocol: str) -> dict[str, bytes]:
    """What a liar writes on one protocol: a huge announced size, a truncated frame, junk."""
    if not protocol.startswith("/peertrain/") or protocol == str(DHT_PROTOCOL):
        # varint-prefixed protobuf (py-libp2p's protocols, the DHT's)
        huge = bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x03]) + b"x" * 64  # announces ~1 GiB
        truncated = bytes([0x80, 0x80, 0x04]) + b"y" * 100  # announces 64 KiB, sends 100
    else:  # our frames: a 4-byte big-endian length
        huge = struct.pack(">I", 2**31) + b"x" * 64
        truncated = struct.pack(">I", 60_000) + b"y" * 100
    return {"huge": huge, "truncated": truncated, "junk": os.urandom(MIB)}


async def test_a_hostile_peer_is_bounded_and_banned_while_training_goes_on(
        testnet_factory, fast_manifest):
    net = testnet_factory(1, manifest=fast_manifest, timeout=180)
    node = nodes(net)[0]
    state_dir = Path(node.state_dir)
    st = wait_until(lambda: (s := status(node)) and (s.get("training") or {}).get("step", 0)
                    > 20 and s, 180, "node1 to train")
    before = memory_kb(node.pid)
    step_before = st["training"]["step"]
    me = Substrate(create_new_key_pair(), [launcher.LOOPBACK])
    hostile = me.peer_id.to_base58()
    latencies: list[float] = []
    held: list = []  # streams kept open (idle, half-sent) until the ban
    opened = refused = 0

    def banned() -> bool:
        return hostile in ((status(node).get("guard") or {}).get("bans") or {})

    async def poll_status(done: trio.Event) -> None:
        """`node status` timed from the outside, every 0.25 s while the attack runs."""
        def one() -> float:
            t = time.monotonic()
            try:
                query_control(state_dir, "status")
            except Exception:
                return float("inf")  # no answer at all
            return time.monotonic() - t

        while not done.is_set():
            latencies.append(await trio.to_thread.run_sync(one))
            await trio.sleep(0.25)

    async def open_stream(peer, protocol: str):
        nonlocal opened, refused
        try:
            with trio.fail_after(5):
                stream = await me.open_stream(peer, protocol)
            opened += 1
            return stream
        except Exception:
            refused += 1
            return None

    async def attack(peer, protocol: str) -> None:
        with trio.move_on_after(ATTACK_S):
            for _ in range(IDLE_PER_PROTOCOL):
                if (s := await open_stream(peer, protocol)) is not None:
                    held.append(s)
            for kind, data in payloads(protocol).items():
                for _ in range(BAD_FRAMES_PER_KIND):
                    s = await open_stream(peer, protocol)
                    if s is None:
                        continue
                    try:
                        with trio.fail_after(10):
                            await s.write(data)
                    except Exception:
                        continue
                    if kind == "junk":
                        with trio.move_on_after(2), contextlib.suppress(Exception):
                            await s.close()
                    else:
                        held.append(s)

    async def gossip_junk() -> None:
        with trio.move_on_after(ATTACK_S):
            assert me.pubsub is not None
            for topic in (hb.topic(net.run_id), meta_topic(net.run_id)):
                await me.pubsub.subscribe(topic)
            for _ in range(6):
                for topic in (hb.topic(net.run_id), meta_topic(net.run_id)):
                    with contextlib.suppress(Exception):
                        await me.pubsub.publish(topic, os.urandom(1_000_000))
                await trio.sleep(0.2)  # paced, as a publisher must be (notes/libp2p.md §5)

    started = time.monotonic()
    async with trio.open_nursery() as outer:
        await outer.start(me.serve)
        peer = await me.connect(st["addrs"][0])
        def listed() -> list[str]:
            try:
                protocols = sorted(map(str, me.host.get_peerstore().get_protocols(peer)))
            except Exception:  # identify has not answered yet
                return []
            return protocols if set(PROTOCOLS) <= set(protocols) else []

        served = await await_until(listed, 30, "the node's identify answer")
        done = trio.Event()
        outer.start_soon(poll_status, done)
        async with trio.open_nursery() as attackers:
            attackers.start_soon(gossip_junk)
            for protocol in served:
                attackers.start_soon(attack, peer, protocol)
        await await_until(banned, 120, "the node to ban the hostile peer")
        ban_after = time.monotonic() - started
        # Banned: it may dial again, and is refused (connection closed, streams reset).
        for _ in range(3):
            try:
                with trio.fail_after(10):
                    await me.connect(st["addrs"][0])
                assert await open_stream(peer, mx.PROTOCOL_ID) is None
            except Exception:
                pass
        done.set()
        outer.cancel_scope.cancel()

    after = memory_kb(node.pid)
    final = wait_until(lambda: status(node), 60, "node1's status")
    guard = final["guard"]
    print(f"{len(served)} protocols; ban after {ban_after:.1f} s; streams opened {opened}, "
          f"refused {refused}; "
          f"VmHWM {before['VmHWM'] // 1024} -> {after['VmHWM'] // 1024} MB, VmRSS "
          f"{before['VmRSS'] // 1024} -> {after['VmRSS'] // 1024} MB; status latency max "
          f"{max(latencies):.3f} s over {len(latencies)} queries; "
          f"refused {guard['refused']}; misbehaviour {guard['misbehaviour']}; "
          f"logs {guard['logs']}")
    assert (after["VmHWM"] - before["VmHWM"]) < 64 * 1024, (before, after)
    assert latencies and max(latencies) < 1.0, sorted(latencies)[-5:]
    assert guard["bans"][hostile]["until_unix"] > time.time()
    assert refused > 0  # the budget said no before the ban, or the ban did
    wait_until(lambda: training(node).get("step", 0) > step_before + 50, 120,
               "node1 to keep training")
    # No line flood: the node's log holds at most a few lines per (peer, reason) a minute.
    lines = (state_dir / "node.log").read_text().splitlines()
    about = [line for line in lines if hostile in line]
    assert len(about) < 200, len(about)
    # The node kept its bootstrap connection (no redial loop after the junk gossip).
    assert sum("reconnected to" in line for line in lines) < 5
