"""Interop with a real third-party peer: a js-libp2p node (tests/interop/js/peer.mjs) dials a
real peertrain node process, pings it, reads its signed DHT record over peertrain's own DHT
protocol, and receives one of its heartbeats by gossip. The bytes js got are checked with
peertrain's own decoders. See docs/interop.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from node.status.control import query_control
from protocols import heartbeat, records

JS = Path(__file__).resolve().parents[1] / "interop" / "js"
NPM_TIMEOUT_S = 300
PEER_TIMEOUT_S = 60  # peer.mjs's own watchdog fires at 55 s
STEPS = ["connect", "ping", "dht-get", "gossip"]

pytestmark = pytest.mark.interop


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def find_nodejs() -> Path | None:
    """Node.js on PATH. Not just `which node`: peertrain's own CLI is also called `node`,
    and comes first on PATH in an activated virtualenv."""
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory or ".") / "node"
        if not (candidate.is_file() and os.access(candidate, os.X_OK)):
            continue
        try:
            r = subprocess.run(
                [candidate, "-e", "process.stdout.write(process.version)"],
                capture_output=True,
                text=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.startswith("v"):
            return candidate
    return None


def js_env(nodejs: Path) -> dict[str, str]:
    # npm runs under `#!/usr/bin/env node`: put Node.js's directory first on PATH.
    return {**os.environ, "PATH": f"{nodejs.parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def install_js_peer() -> Path:
    """Skip without Node.js or npm; install node_modules if missing or stale; return Node.js.

    A failing install, with npm present, fails the test with npm's output.
    """
    nodejs, npm = find_nodejs(), shutil.which("npm")
    missing = [name for name, path in (("Node.js (node)", nodejs), ("npm", npm)) if path is None]
    if nodejs is None or npm is None:
        pytest.skip(
            f"{' and '.join(missing)} not on PATH: the js-libp2p interop test needs "
            "Node.js >= 20 and npm"
        )
    version = subprocess.run(
        [nodejs, "-e", "process.stdout.write(process.versions.node)"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert int(version.split(".")[0]) >= 20, f"{nodejs} is Node.js {version}; js-libp2p needs 20+"
    lock = JS / "package-lock.json"
    installed = JS / "node_modules" / ".package-lock.json"  # npm writes it on every install
    if (
        installed.exists()
        and (JS / "node_modules" / "libp2p").exists()
        and (not lock.exists() or installed.stat().st_mtime >= lock.stat().st_mtime)
    ):
        return nodejs
    cmd = [npm, "ci" if lock.exists() else "install", "--no-audit", "--no-fund", "--loglevel=error"]
    shown = " ".join(["npm", *cmd[1:]])
    try:
        r = subprocess.run(
            cmd,
            cwd=JS,
            env=js_env(nodejs),
            capture_output=True,
            text=True,
            timeout=NPM_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"`{shown}` in {JS} took over {NPM_TIMEOUT_S} s:\n{_text(e.stdout)}\n{_text(e.stderr)}"
        )
    assert r.returncode == 0, (
        f"`{shown}` in {JS} failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
    )
    return nodejs


def run_js_peer(nodejs: Path, addr: str, peer_id: str, run_id: str) -> tuple[dict[str, dict], str]:
    """Run peer.mjs; return its step results by name, and its whole output for messages."""
    cmd = [nodejs, "--import", "./polyfill.mjs", "peer.mjs", addr, peer_id, run_id]
    try:
        r = subprocess.run(
            cmd,
            cwd=JS,
            env=js_env(nodejs),
            capture_output=True,
            text=True,
            timeout=PEER_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        stdout, stderr, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stderr, rc = _text(e.stdout), _text(e.stderr), f"killed after {PEER_TIMEOUT_S} s"
    steps: dict[str, dict] = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            steps[doc["step"]] = doc
    return steps, f"peer.mjs exit {rc}\n--- stdout\n{stdout}\n--- stderr\n{stderr[-4000:]}"


def test_js_libp2p_peer_pings_reads_dht_and_gets_gossip(testnet_factory):
    nodejs = install_js_peer()
    net = testnet_factory(1, extra_node_args=["--no-train"])
    proc = next(p for p in net.procs if p.name == "node1")
    status = query_control(Path(proc.state_dir))
    node_id, addr = status["peer_id"], status["addrs"][0]

    steps, output = run_js_peer(nodejs, addr, node_id, net.run_id)
    print(output)
    failed = [s for s in STEPS if not steps.get(s, {}).get("ok")]
    assert not failed, f"steps failed or missing: {failed}\n{output}"

    # connect: TCP + Noise + Yamux to the right peer; identify shows what the node serves.
    connect = steps["connect"]
    assert connect["remote"] == node_id
    assert (connect["encryption"], connect["muxer"]) == ("/noise", "/yamux/1.0.0")
    protocols = set(connect["protocols"])
    assert {"/ipfs/ping/1.0.0", "/peertrain/kad/1.0.0", "/meshsub/1.2.0"} <= protocols, protocols
    assert "/ipfs/kad/1.0.0" not in protocols  # peertrain stays off the public IPFS DHT

    assert steps["ping"]["rtt_ms"] >= 0

    # dht-get: the record is the node's own, signed by it, naming the run and its address.
    got = steps["dht-get"]
    assert got["key"] == records.peer_key(node_id)
    record = records.decode(got["key"], bytes.fromhex(got["value"]))
    assert record.peer_id == node_id
    assert net.run_id in record.runs
    assert addr in record.addrs, record.addrs

    # gossip: a heartbeat the node signed, on the run's topic.
    gossip = steps["gossip"]
    assert gossip["topic"] == heartbeat.topic(net.run_id)
    assert gossip["from"] == node_id
    beat = heartbeat.decode(bytes.fromhex(gossip["data"]), gossip["from"])
    assert beat.peer == node_id and beat.seq >= 1
