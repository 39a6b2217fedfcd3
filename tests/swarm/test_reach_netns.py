"""Reachability in network namespaces (testnet/netns.py: each namespace its own machine,
198.18/15 addresses, a router between them): real hosts in their own processes ask real
AutoNAT servers to dial them back.

* A public node whose first dial-back fails becomes public. Its namespace has a second
  address that it uses towards one server only (a source route), so that server sees it
  at an address nobody listens on and answers "unreachable"; two others reach it. The old
  rule (3 agreeing answers, else keep the verdict) left it private for good.
* A node nobody outside its machine can dial never says public, though a server on its
  own machine reaches it. It listens on an address only its own machine routes (on `lo`),
  and connects out from one nobody listens on: the outside's dial-backs are refused at
  once, as a firewall that rejects would. The old rule took the local server's one
  "reached" for public.

Needs root and iproute2 (skipped with the reason otherwise); nothing changes outside the
namespaces created here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testnet import netns
from tests.conftest import REPO

SERVER = """
import sys, trio
from libp2p.crypto.ed25519 import create_new_key_pair
from node.reach import autonat
from p2p.host import Substrate
async def main():
    s = Substrate(create_new_key_pair(), [sys.argv[1]])
    async with trio.open_nursery() as n:
        await n.start(s.serve)
        s.set_handler(autonat.PROTOCOL_ID, autonat.server_handler(s))
        print(s.addrs()[0], flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the test closes stdin
        n.cancel_scope.cancel()
trio.run(main)
"""

# argv: listen address, then JSON [[addresses to connect to, checks to run], ...]: one
# JSON line per check with the verdict and this round's answers.
SUBJECT = """
import json, sys, trio
from libp2p.crypto.ed25519 import create_new_key_pair
from node.reach.service import ReachabilityService
from p2p.host import Substrate
async def main():
    s = Substrate(create_new_key_pair(), [sys.argv[1]])
    reach = ReachabilityService(upnp=False)
    async with trio.open_nursery() as n:
        await n.start(s.serve)
        for phase, (addrs, checks) in enumerate(json.loads(sys.argv[2])):
            for a in addrs:
                await s.connect(a, timeout=20)
            for _ in range(checks):
                with trio.fail_after(60):
                    state = await reach.check(s)
                print(json.dumps({"phase": phase, "state": state,
                                  "answers": [a.status for a in reach.answers]}), flush=True)
        n.cancel_scope.cancel()
trio.run(main)
"""


@pytest.fixture
def topo(tmp_path):
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    t = netns.create(netns.tag_for(str(tmp_path)), ["subject", "s1", "s2", "s3"],
                     workdir=str(tmp_path))
    procs: list[subprocess.Popen] = []
    t.procs = procs  # type: ignore[attr-defined]
    try:
        yield t
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        netns.destroy(t)
    assert netns.existing(t.tag) == []


def _ip(t: netns.Topology, name: str, *args: str) -> None:
    subprocess.run(["ip", "-n", t.ns(name), *args], check=True, capture_output=True,
                   timeout=10)


def _server(t: netns.Topology, where: str, listen: str) -> str:
    p = subprocess.Popen([*t.exec_prefix(where), sys.executable, "-c", SERVER, listen],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    t.procs.append(p)  # type: ignore[attr-defined]
    line = p.stdout.readline().strip()  # type: ignore[union-attr]
    assert line.startswith("/ip4/"), f"server in {where} did not start"
    return line


def _subject(t: netns.Topology, listen: str, phases: list) -> list[dict]:
    r = subprocess.run([*t.exec_prefix("subject"), sys.executable, "-c", SUBJECT, listen,
                        json.dumps(phases)], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


@pytest.mark.slow  # four processes in namespaces
def test_a_public_node_whose_first_dial_back_fails_becomes_public(topo):
    i = topo.nodes["subject"]
    second, gw = f"{netns.SUBNET}.{i}.3", f"{netns.SUBNET}.{i}.1"
    _ip(topo, "subject", "addr", "add", f"{second}/24", "dev", "eth0")
    # towards s1 the subject's connections leave from its second address, where nobody
    # listens: s1 sees it there and its dial-back fails
    _ip(topo, "subject", "route", "add", f"{topo.ip('s1')}/32", "via", gw, "src", second)
    servers = {n: _server(topo, n, topo.listen(n)) for n in ("s1", "s2", "s3")}
    lines = _subject(topo, topo.listen("subject"), [
        [[servers["s1"]], 1],  # only s1 to ask: "unreachable", so private
        [[servers["s2"], servers["s3"]], 3],  # s1 still fails, s2 and s3 reach it
    ])
    assert lines[0]["state"] == "private", lines
    assert lines[0]["answers"] in (["unreachable"], ["refused"]), lines
    assert any(x["answers"].count("reached") == 2 for x in lines[1:]), lines
    assert lines[-1]["state"] == "public", lines


@pytest.mark.slow  # four processes in namespaces
def test_a_node_nobody_outside_can_dial_never_says_public(topo):
    hidden = "198.19.250.2"  # on lo: the router has no route to it
    _ip(topo, "subject", "addr", "add", f"{hidden}/32", "dev", "lo")
    local = _server(topo, "subject", f"/ip4/{hidden}/tcp/0")  # a bootstrap on its machine
    servers = [_server(topo, n, topo.listen(n)) for n in ("s1", "s2")]
    lines = _subject(topo, f"/ip4/{hidden}/tcp/0", [
        [[local], 2],  # the local server reaches it: that proves nothing
        [servers, 3],
    ])
    assert all(x["state"] != "public" for x in lines), lines
    assert lines[0]["answers"] == ["reached"], lines
    assert lines[-1]["state"] == "private", lines
