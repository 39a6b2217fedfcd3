"""Bad input against real node processes: each gets a clear answer, no traceback, no dead host."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from node.run import manifest as manifest_service
from p2p.host import Substrate
from protocols import manifest as mf
from protocols import manifest_exchange as mx
from testnet import launcher
from tests.conftest import answer, await_until, cli, run_cli, shared_testnet, status

UNKNOWN_RUN = mf.run_id(b"no such run")


def test_malformed_run_id_is_refused_before_anything_starts(tmp_path):
    r = cli("join", "not-a-run-id", "--state-dir", str(tmp_path / "n"))
    assert r.returncode == 2
    assert "not a peertrain run-id" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # starts `node join` (a node process)
def test_unreachable_bootstrap(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
    r = run_cli("join", UNKNOWN_RUN, "--state-dir", str(tmp_path / "n"),
                "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}", "--no-train")
    assert r.returncode == 3, r.stderr
    assert "could not reach any bootstrap peer" in r.stderr
    assert "connection refused" in r.stderr  # the cause, dug out of py-libp2p's wrappers
    assert "Traceback" not in r.stderr


def test_bootstrap_that_is_not_a_multiaddr(tmp_path):
    """A usage error (exit 2), refused before the node starts: nothing is written."""
    r = cli("join", UNKNOWN_RUN, "--state-dir", str(tmp_path / "n"),
                "--bootstrap", "localhost:4001", "--no-train")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: --bootstrap localhost:4001: not a peer multiaddr")
    assert not (tmp_path / "n").exists()


#: One idle node for the tests that join it with a wrong id or send it garbage.
net = shared_testnet(1, extra_node_args=["--no-train"], timeout=120)


@pytest.mark.slow
def test_wrong_run_id_names_the_run_and_what_to_check(net):
    r = run_cli("join", UNKNOWN_RUN, "--bootstrap", net.bootstrap_addr, "--state-dir",
                str(Path(net.dir) / "stranger"), "--join-timeout", "3", "--no-train",
                "--listen", launcher.LOOPBACK)
    assert r.returncode == 4, r.stderr
    assert f"could not get the manifest of run {UNKNOWN_RUN}" in r.stderr
    assert "does not hold run" in r.stderr
    assert "Traceback" not in r.stderr


def test_invalid_manifest_names_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('schema = 1\n[run]\nname = "x"\n[outer]\ninner_steps = 0\n')
    r = cli("run", "create", str(bad), "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 2
    assert "outer.inner_steps" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
async def test_manifest_that_does_not_match_its_id_is_rejected(tmp_path):
    """A hostile peer serves other bytes under a run-id: the joiner refuses them."""
    honest = mf.canonical_bytes(mf.load_manifest_file(launcher.default_manifest_path()))
    wanted = mf.run_id(honest)
    forged = honest.replace(b"testnet-default", b"testnet-evilrun")
    liar = Substrate(create_new_key_pair(), [launcher.LOOPBACK])

    async def serve_forgery(stream):
        await stream.read(4096)
        await stream.write(mx.encode_response(1, wanted, forged))
        await stream.close()

    liar.set_handler(mx.PROTOCOL_ID, serve_forgery)
    async with trio.open_nursery() as nursery:
        await nursery.start(liar.serve)
        r = await trio.to_thread.run_sync(lambda: run_cli(
            "join", wanted, "--bootstrap", liar.addrs()[0], "--state-dir",
            str(tmp_path / "joiner"), "--join-timeout", "3", "--no-train",
            "--listen", launcher.LOOPBACK))
        nursery.cancel_scope.cancel()
    assert r.returncode == 5, r.stderr
    assert "served a bad manifest" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "joiner" / "runs" / f"{wanted}.json").exists()


@pytest.mark.slow
async def test_garbage_and_oversized_frames_do_not_hurt_the_node(net):
    node = next(p for p in net.procs if p.name == "node1")
    addr = answer(node)["addrs"][0]
    me = Substrate(create_new_key_pair(), [launcher.LOOPBACK])
    async with trio.open_nursery() as nursery:
        await nursery.start(me.serve)
        peer = await me.connect(addr)
        for payload in (struct.pack(">I", 2**31) + b"x" * 64,   # oversized length prefix
                        struct.pack(">I", 9) + b"\xc1" * 9,     # not msgpack
                        b"\x00\x00"):                           # truncated, then EOF
            stream = await me.open_stream(peer, mx.PROTOCOL_ID)
            await stream.write(payload)
            await stream.close_write() if hasattr(stream, "close_write") else None
            with trio.fail_after(30):  # a loaded node answers late, not never
                try:
                    while await stream.read(1024):
                        pass
                except (StreamEOF, Exception):
                    pass  # the node resets or closes the stream: either is fine
        # The node is alive, counted the bad streams, and still serves a good request.
        # The node finishes each bad stream on its own time: wait for its count, bounded.
        def p2p() -> dict:
            return status(node).get("p2p") or {}

        st = await await_until(lambda: (s := p2p()).get("handler_errors", 0) >= 3 and s,
                               60, "the node to count 3 bad streams")
        assert st["host_restarts"] == 0
        m = await manifest_service.fetch_manifest(me, peer, net.run_id)
        assert m.run.name.startswith("testnet-default.")  # tagged with its testnet
        nursery.cancel_scope.cancel()
    logs = (Path(node.state_dir) / "node.log").read_text().splitlines()
    reasons = [json.loads(line)["msg"] for line in logs if "handler" in line]
    assert any("exceeds" in r or "limit" in r for r in reasons), reasons


@pytest.mark.slow  # `node join` loads the manifest and torch before it refuses
@pytest.mark.parametrize(("section", "reason"), [
    ('[model]\nn_layers = 4\n[outer]\nalgorithm = "diloco"\n[pipeline]\nstages = 4\n',
     "a [pipeline] run's replicas average by 'noloco'"),
])
def test_runs_a_swarm_cannot_train_are_refused_by_join_with_a_reason(tmp_path, section, reason):
    manifest = tmp_path / "run.toml"
    manifest.write_text('schema = 1\n[run]\nname = "d"\n' + section)
    state = tmp_path / "node"
    r = run_cli("run", "create", str(manifest), "--state-dir", str(state))
    assert r.returncode == 0, r.stderr
    r = run_cli("join", r.stdout.strip(), "--state-dir", str(state), "--listen",
                launcher.LOOPBACK, "--device", "cpu")
    assert r.returncode == 7, r.stderr
    assert reason in r.stderr
    assert "Traceback" not in r.stderr
