"""The run document across real node processes: convergence, persistence, forged entries."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.run.rundoc_sync import now_ms, topic
from p2p.host import Substrate
from protocols import keys, rundoc
from testnet import launcher
from tests.conftest import answer, await_until, members, nodes, shared_testnet, status, wait_until

pytestmark = pytest.mark.slow  # every test here starts node processes


def saved_entries(path: Path, run_id: str) -> int:
    """How many entries the replica saved at `path` holds (0: none saved yet)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    signer = keys.Signer(create_new_key_pair().private_key.to_bytes()[:32])
    return len(rundoc.RunDocument.from_bytes(data, run_id, signer, []))


def digests(net: launcher.Testnet) -> set[str]:
    return {(status(p).get("run_document") or {}).get("digest") for p in net.procs
            if p.name != "bootstrap"}


#: Three idle nodes for both tests: the forged entries go to node1 (restarted or not).
net = shared_testnet(3, extra_node_args=["--no-train"], timeout=120)


def test_replicas_converge_and_survive_a_restart(net):
    members3 = nodes(net)
    for p in members3:
        wait_until(lambda p=p: len(members(p)) == 2, 60,
                   f"{p.name} to list 2 members from its run document")
    # Peers rewrite their last_seen every 2 s, so digests match only between rewrites:
    # check that each node holds every peer's entries instead.
    for p in members3:
        listed = {m["peer_id"]: m for m in answer(p)["membership"]["members"]}
        assert all(m["role"] == "node" and m["addrs"] for m in listed.values())
    node1 = members3[0]
    saved = Path(node1.state_dir) / f"rundoc-{net.run_id}.bin"
    # Not just "a file exists": the first save (2 s after joining) may hold only node1's
    # own entries. Wait for a save (every 10 s) that holds all three peers' entries (2 each:
    # `info` and `last_seen`, node/run/rundoc_sync.py).
    held = wait_until(lambda: (n := saved_entries(saved, net.run_id)) >= 6 and n, 60,
                      "a saved run document with every peer's entries")
    launcher.kill_node(net, "node1")
    wait_until(lambda: not launcher.alive(node1.pid, node1.state_dir), 30, "node1 to die")
    launcher.restart_node(net, "node1")
    node1 = next(p for p in net.procs if p.name == "node1")
    wait_until(lambda: status(node1).get("phase") == "running", 120, "node1 to restart")
    # Reloaded from disk, not synced again from the others: the log says what was loaded
    # (the saved file may have grown since `held` was read; it never shrank).
    log = Path(node1.state_dir) / "node.log"
    loaded = [int(line.split("loaded run document: ")[1].split(" ")[0])
              for line in log.read_text().splitlines() if "loaded run document: " in line]
    assert loaded and loaded[-1] >= held, (loaded, held)


async def test_forged_and_foreign_entries_are_rejected(net):
    """A peer gossips an entry in another peer's namespace and one with a bad signature."""
    node = next(p for p in net.procs if p.name == "node1")
    victim = answer(node)["peer_id"]
    kp = create_new_key_pair()
    evil = Substrate(kp, [launcher.LOOPBACK])
    signer = keys.Signer(kp.private_key.to_bytes()[:32])
    mine = rundoc.RunDocument(net.run_id, signer, [])
    trespass = rundoc.sign_entry(net.run_id, signer, f"peer/{victim}/addrs", ["/evil"],
                                 rundoc.Stamp(now_ms(), 0, signer.peer_id))
    good = rundoc.sign_entry(net.run_id, signer, f"peer/{signer.peer_id}/role", "node",
                             rundoc.Stamp(now_ms(), 1, signer.peer_id))
    forged = rundoc.Entry(good.key, good.packed, good.hlc, False, b"\x00" * 64)
    st = answer(node)
    before = st["run_document"]["rejected"]
    async with trio.open_nursery() as nursery:
        await nursery.start(evil.serve)
        await evil.connect(st["addrs"][0])
        await evil.pubsub.subscribe(topic(net.run_id))

        async def publish() -> None:  # again and again: gossip before the mesh forms is lost
            while True:
                await evil.pubsub.publish(topic(net.run_id),
                                          mine.encode_delta([trespass, forged]))
                await trio.sleep(0.5)

        nursery.start_soon(publish)
        await await_until(lambda: (status(node).get("run_document") or {})
                          .get("rejected", 0) >= before + 2, 60,
                          "the node to reject both entries")
        nursery.cancel_scope.cancel()
    st = answer(node)
    assert all("/evil" not in m.get("addrs", []) for m in st["membership"]["members"])
    log = (Path(node.state_dir) / "node.log").read_text()
    assert "rejected peer/" in log
