"""A LAN join by run-id alone: two "machines" (network namespaces joined by a veth pair,
198.18.0.1 and 198.18.0.2), a `node bootstrap` serving the run on one, `node join <run-id>`
on the other with no --bootstrap, no variable, no config file and no remembered peers:
mDNS finds the bootstrap. Root only (namespaces); the root namespace is never changed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from node.status.control import NETNS_ENV, query_control
from testnet import netns
from tests.conftest import FAST_RUN, REPO, cli, wait_until

pytestmark = pytest.mark.slow


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def lan():
    reason = netns.available()
    if reason:
        pytest.skip(f"mDNS LAN test: {reason}")
    tag = f"ptmd{os.getpid() % 100000}"
    names = [f"{tag}a", f"{tag}b"]
    for n in names:
        ip("netns", "add", n)
    try:
        ip("link", "add", f"{tag}va", "netns", names[0], "type", "veth", "peer", "name",
           f"{tag}vb", "netns", names[1])
        for i, (n, dev) in enumerate(zip(names, (f"{tag}va", f"{tag}vb"), strict=True)):
            ip("-n", n, "link", "set", "lo", "up")
            ip("-n", n, "addr", "add", f"198.18.0.{i + 1}/24", "dev", dev)
            ip("-n", n, "link", "set", dev, "up")
        yield names
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def start(ns: str, *args: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", NETNS_ENV: ns,
           "XDG_CONFIG_HOME": str(log.parent / "xdg")}
    env.pop("PEERTRAIN_BOOTSTRAP", None)
    env.pop("PEERTRAIN_CONFIG", None)
    out = open(log, "wb")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "cli", *args],
                                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    finally:
        out.close()


def phase(state: Path) -> str | None:
    try:
        return query_control(state, timeout=2.0).get("phase")
    except Exception:
        return None


def test_a_node_on_the_lan_joins_by_run_id_alone_through_mdns(lan, tmp_path: Path):
    manifest = tmp_path / "fast.toml"
    manifest.write_text(FAST_RUN)
    a, b = tmp_path / "a", tmp_path / "b"
    r = cli("run", "create", str(manifest), "--state-dir", str(a))
    assert r.returncode == 0, r.stderr
    run_id = r.stdout.strip()
    procs = []
    try:
        procs.append(start(lan[0], "bootstrap", "--listen", "/ip4/198.18.0.1/tcp/0",
                           "--state-dir", str(a), log=tmp_path / "a.log"))
        wait_until(lambda: phase(a) == "running", 120, "the bootstrap to run")
        procs.append(start(lan[1], "join", run_id, "--no-train", "--device", "cpu",
                           "--listen", "/ip4/198.18.0.2/tcp/0", "--state-dir", str(b),
                           log=tmp_path / "b.log"))
        wait_until(lambda: phase(b) == "running" or procs[1].poll() is not None, 120,
                   "the joiner to run")
        log = (tmp_path / "b.log").read_text()
        assert phase(b) == "running", log[-3000:]
        assert "reached 1 peer(s) through mDNS" in log
        assert query_control(b)["run"] == run_id
        assert "/ip4/198.18.0.1/" in log  # found at the bootstrap's LAN address
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
