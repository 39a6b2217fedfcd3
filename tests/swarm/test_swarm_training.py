"""Training in a real swarm: loss falls everywhere, churn never stalls, bad partners are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.checkpoints.store import CheckpointStore
from node.transport.streams import write_chunks
from p2p.host import Substrate
from protocols import averaging as av
from protocols import heartbeat as hb
from protocols.wire import NEED_DATA, encode_tensor_frame, make_tensor_header
from testnet import launcher
from tests.conftest import (
    FAST_RUN,
    await_until,
    cli,
    nodes,
    peers,
    shared_testnet,
    status,
    training,
    wait_until,
)

pytestmark = pytest.mark.slow  # every test here starts node processes



#: One 3-node NoLoCo swarm for the tests that watch it train: the loss test, then the
#: SIGKILL test, which restarts the node it kills (it comes last of the two).
swarm = shared_testnet(3, FAST_RUN, timeout=180)


def test_loss_falls_on_every_node_and_rounds_are_averaged(swarm):
    net = swarm
    for p in nodes(net):
        t = wait_until(lambda p=p: (t := training(p)).get("rounds_averaged", 0) >= 3
                       and t["val_loss"] is not None and t["val_loss"] < t["first_val_loss"]
                       and t, 240, f"{p.name} to average 3 rounds with falling validation loss")
        assert t["bytes_sent"] > 0 and t["bytes_received"] > 0 and t["last_partner"]


def test_diloco_all_reduces_across_three_nodes_while_the_trainers_wait(testnet_factory,
                                                                        tmp_path):
    """The baseline live: 3 nodes (not a power of two, so one node folds onto a partner
    and takes the mean back) all-reduce every round, and their trainers wait for it."""
    manifest = tmp_path / "diloco.toml"
    manifest.write_text(FAST_RUN.replace('algorithm = "noloco"', 'algorithm = "diloco"')
                        .replace("inner_steps = 100", "inner_steps = 50"))
    net = testnet_factory(3, manifest=manifest, timeout=180)
    for p in nodes(net):
        t = wait_until(lambda p=p: (t := training(p)).get("rounds_averaged", 0) >= 3 and t,
                       240, f"{p.name} to all-reduce 3 rounds")
        assert t["sync_wait_s"] > 0
        partners = (status(p).get("averaging") or {}).get("partners") or {}
        assert sum(x["exchanges"] for x in partners.values()) >= 3


def test_sigkill_mid_run_does_not_stall_the_others(swarm):
    net = swarm
    node1, node2, node3 = nodes(net)
    for p in (node1, node2):
        wait_until(lambda p=p: training(p).get("rounds_averaged", 0) >= 2, 240,
                   f"{p.name} to average")
    launcher.kill_node(net, "node3")
    wait_until(lambda: not launcher.alive(node3.pid, node3.state_dir), 30, "node3 to die")
    # Counted after node3 is gone: nothing of what comes next can be node3's doing.
    before = {p.name: wait_until(lambda p=p: training(p), 60, f"{p.name}'s status")
              for p in (node1, node2)}
    for p in (node1, node2):
        # Steps go on and the two survivors keep pairing with each other.
        wait_until(lambda p=p: training(p).get("step", 0) >= before[p.name]["step"] + 60, 120,
                   f"{p.name} to keep stepping")
        wait_until(lambda p=p: training(p).get("rounds_averaged", 0)
                   >= before[p.name]["rounds_averaged"] + 3, 180, f"{p.name} to re-pair")
    launcher.restart_node(net, "node3")
    node3 = next(p for p in net.procs if p.name == "node3")
    wait_until(lambda: training(node3).get("rounds_averaged", 0) >= 1, 240,
               "the restarted node3 to be paired again")


async def test_hostile_partner_is_refused_and_training_goes_on(testnet_factory, fast_manifest):
    """A member that sends NaN weights, a wrong size, an unknown codec or a truncated frame:
    each is refused with a logged reason, the round falls back to a local step, and the
    node's weights stay finite."""
    net = testnet_factory(1, manifest=fast_manifest, timeout=180)
    node = nodes(net)[0]
    st = wait_until(lambda: (s := status(node)) and (s.get("training") or {}).get("step", 0)
                    > 20 and s, 120, "node1 to train")
    numel, victim = st["training"]["params"], st["peer_id"]
    # The attacker must be the dialing side of the pair: the smaller peer id dials. Drawn
    # until one is (2000 draws missed a victim with a small id about once in 2000 runs).
    kp = next(k for k in iter(create_new_key_pair, None)
              if ID.from_pubkey(k.public_key).to_base58() < victim)
    me = Substrate(kp, [launcher.LOOPBACK])
    my_id = me.peer_id.to_base58()
    async with trio.open_nursery() as nursery:
        await nursery.start(me.serve)
        peer = await me.connect(st["addrs"][0])

        async def heartbeats() -> None:  # join the run's membership like any node
            for seq in range(1, 10_000):
                beat = hb.Heartbeat(my_id, seq, tuple(me.addrs()), stats={"step": 0})
                await me.pubsub.publish(hb.topic(net.run_id), beat.encode())
                await trio.sleep(0.5)

        nursery.start_soon(heartbeats)
        await await_until(lambda: any(p["peer_id"] == my_id
                                      for p in peers(node)),
                          60, "the node to see the attacker")
        # A try can be refused before the vector is judged: the node's trainer late for
        # that round, or the round over by the time the offer lands (both likelier on a
        # busy machine). Such a try proves nothing, so it is repeated on a fresh round; a
        # try the node accepted (or refused for its size) is judged, and logged.
        log = Path(node.state_dir) / "node.log"
        for attack, refusal in REFUSALS.items():
            for _ in range(20):
                t = await await_until(lambda: training(node), 60, "node1's status")
                outcome = await attack_once(me, peer, net.run_id, t["round"] + 1, numel, attack)
                if outcome == "accepted" or (attack == "size" and "values here" in outcome):
                    break
            else:
                raise AssertionError(f"20 {attack} attacks never got past the offer: {outcome}")
            await await_until(lambda r=refusal: r in log.read_text(), 60,
                              f"node1 to log its refusal of the {attack} attack ({refusal!r})")
        nursery.cancel_scope.cancel()
    step = wait_until(lambda: training(node).get("step"), 60, "node1's status")
    t = wait_until(lambda: (t := training(node)).get("step", 0) > step + 20 and t, 120,
                   "node1 to keep training")
    assert t["loss"] == t["loss"] and t["error"] is None  # finite, no failure


REFUSALS = {  # attack -> what the node logs when it refuses it
    "nan": "NaN",
    "size": "7 values, our model has",
    "codec": "zfp9",
    "truncated": "ended in the middle",
}


async def attack_once(me: Substrate, peer: ID, run_id: str, r: int, numel: int,
                      attack: str) -> str:
    """One attack; returns "accepted", "rejected: <reason>" or "no answer" for the offer."""
    ex = av.Exchange("initiator", run_id, r, 7 if attack == "size" else numel, ["fp32"])
    stream = await me.open_stream(peer, av.PROTOCOL_ID)
    outcome = "no answer"
    with trio.move_on_after(10):  # the node answers, rejects or resets: all are fine
        try:
            await stream.write(ex.initiate())
            while (event := ex.next_event()) is NEED_DATA:
                ex.receive_data(await stream.read(65536))
            if not isinstance(event, av.Accepted):
                return f"rejected: {getattr(event, 'reason', event)}"
            outcome = "accepted"
            vec = torch.zeros(numel)
            vec[5] = float("nan") if attack == "nan" else 0.0
            chunks = ex.send_vector(vec)
            if attack == "codec":  # frames in a codec nobody agreed to
                payload = b"\x00" * 64
                header = make_tensor_header("theta/0", "uint8", (64,), "zfp9", payload)
                chunks = encode_tensor_frame(header, payload)
            if attack == "truncated":
                chunks = [bytes(memoryview(chunks[0]).cast("B"))[:-3]]
            await write_chunks(stream, chunks)
            await stream.close()
            while await stream.read(65536):
                pass
        except Exception:
            pass
    return outcome


def test_checkpoints_are_written_announced_and_resumed(testnet_factory, tmp_path):
    manifest = tmp_path / "ckpt.toml"
    manifest.write_text(FAST_RUN + "[checkpoint]\nevery_steps = 200\nkeep = 2\n")
    net = testnet_factory(1, manifest=manifest, timeout=180)
    node = nodes(net)[0]
    wait_until(lambda: training(node).get("checkpoints", 0) >= 3, 240, "three checkpoints")
    # keep = 2: the first checkpoint was deleted, and so was its run-document entry
    st = wait_until(lambda: (s := status(node)) and (s.get("run_document") or {})
                    .get("tombstones", 0) >= 1 and s, 60,
                    "retention to delete the first checkpoint's entry")
    # own peer entries (info, last_seen) + peer/<id>/ckpt/<cid>
    assert st["run_document"]["entries"] >= 3
    # The store is read once the node is stopped: a running node writes a checkpoint every
    # 200 steps (a fraction of a second) and deletes all but 2, so a cid read from its
    # status could be gone before `ckpt verify` (a second to start) opens it.
    launcher.kill_node(net, "node1")
    wait_until(lambda: not launcher.alive(node.pid, node.state_dir), 30, "node1 to die")
    r = cli("ckpt", "ls", "--state-dir", node.state_dir)
    assert r.returncode == 0 and "Qm" in r.stdout, r.stderr
    held = CheckpointStore(Path(node.state_dir)).list(net.run_id)
    assert 1 <= len(held) <= 3, held  # keep = 2 (+1 if the kill came between save and trim)
    r = cli("ckpt", "verify", held[-1][0], "--state-dir", node.state_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    launcher.restart_node(net, "node1")
    node = nodes(net)[0]
    wait_until(lambda: training(node).get("step", 0) > 0, 120, "node1 to train again")
    log = (Path(node.state_dir) / "node.log").read_text()
    assert "resumed from checkpoint" in log


def test_a_node_joining_mid_run_downloads_the_newest_checkpoint(testnet_factory, tmp_path):
    manifest = tmp_path / "ckpt.toml"
    # keep = 1000: retention must not delete the checkpoint the latecomer is downloading
    # (with keep = 2 the two nodes wrote two newer ones within seconds, while the latecomer
    # was still looking for providers: a race the download then lost).
    manifest.write_text(FAST_RUN + "[checkpoint]\nevery_steps = 300\nkeep = 1000\n")
    net = testnet_factory(2, manifest=manifest, timeout=180)
    for p in nodes(net):
        wait_until(lambda p=p: training(p).get("checkpoints", 0) >= 1, 240, "a checkpoint")
    late = launcher.add_node(net, "latecomer")  # in net.procs: the fixture stops it too
    state = Path(late.state_dir)
    st = wait_until(lambda: (s := status(late)) and (s.get("training") or {}).get("step", 0) > 0
                    and s, 240, "the latecomer to train")
    log = (state / "node.log").read_text()
    assert "fetched checkpoint" in log and "resumed from checkpoint" in log, log[-3000:]
    download = st["checkpoints"]["download"]
    assert download["done"] == download["total"] > 0

    probes = iter(range(1000))

    def latecomer_provides() -> bool:  # what a second joiner would find in the DHT
        fresh = tmp_path / f"probe{next(probes)}"  # an empty store: a held cid skips the DHT
        r = cli("ckpt", "pull", download["cid"], "--bootstrap", net.bootstrap_addr,
                    "--state-dir", str(fresh), "--json")
        return r.returncode == 0 and st["peer_id"] in json.loads(r.stdout)["dht_providers"]

    wait_until(latecomer_provides, 180, "the latecomer to provide the checkpoint it pulled")
