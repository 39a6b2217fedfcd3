"""`node ckpt pull` against real running nodes: parallel pull, verification, and the error
a user sees for an unknown id, an unreachable peer, a damaged provider, another run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from node.checkpoints.store import CheckpointStore
from protocols.checkpoint import CHUNK_BYTES
from testnet import launcher
from tests.conftest import cli

pytestmark = pytest.mark.slow  # starts a testnet

RUN = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"
NOBODY = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGS6T1716viYBvUvYZED6oPcgCwAv4JewvfCZjLUajEPt"


def addr(p: launcher.Proc) -> str:
    return json.loads((Path(p.state_dir) / "addrs.json").read_text())["addrs"][0]


def test_pull_from_two_running_nodes_and_the_errors_users_see(testnet_factory, tmp_path):
    net = testnet_factory(1, extra_node_args=["--no-train"], timeout=120)
    boot, node = net.procs[0], net.procs[1]
    # Both running processes serve what their store holds (they read it per request).
    weights = {"w": torch.randn(5 * CHUNK_BYTES // 4 + 100)}  # 6 chunks
    cid = CheckpointStore(Path(node.state_dir)).save(RUN, 120, weights)
    shutil.copytree(Path(node.state_dir) / "checkpoints", Path(boot.state_dir) / "checkpoints")
    here = tmp_path / "here"

    r = cli(
        "ckpt",
        "pull",
        cid,
        "--from",
        addr(boot),
        "--from",
        addr(node),
        "--state-dir",
        str(here),
        "--json",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["step"] == 120 and doc["chunks"] == 6 and doc["fetched_bytes"] == doc["size"]
    assert sum(p["bytes"] for p in doc["providers"].values()) == doc["size"]
    assert doc["mb_s"] > 0
    manifest, loaded = CheckpointStore(here).load(cid)
    assert torch.equal(loaded["w"], weights["w"])

    r = cli("ckpt", "pull", cid, "--from", addr(node), "--state-dir", str(here))
    assert r.returncode == 0 and "already here and verified" in r.stdout, r.stderr

    # A damaged chunk on disk (an earlier pull cut at the wrong moment) is fetched again.
    chunk = CheckpointStore(here).chunks / manifest.chunks[2]
    chunk.write_bytes(b"rot" + chunk.read_bytes()[3:])
    r = cli("ckpt", "pull", cid, "--from", addr(node), "--state-dir", str(here))
    assert r.returncode == 0, r.stderr
    assert "all verified" in r.stdout and "MB/s" in r.stdout
    assert CheckpointStore(here).verify(cid) == []

    unknown = cid[:-1] + ("A" if cid[-1] != "A" else "B")
    r = cli("ckpt", "pull", unknown, "--from", addr(node), "--state-dir", str(tmp_path / "u"))
    assert r.returncode == 8 and "not held here" in r.stderr, r.stderr
    r = cli(
        "ckpt", "pull", unknown, "--bootstrap", addr(boot), "--state-dir", str(tmp_path / "u")
    )
    assert r.returncode == 8 and "knows no provider" in r.stderr, r.stderr

    r = cli("ckpt", "pull", "Qm123", "--from", addr(node), "--state-dir", str(here))
    assert r.returncode == 2 and "not a checkpoint id" in r.stderr

    r = cli("ckpt", "pull", cid, "--from", NOBODY, "--state-dir", str(tmp_path / "x"))
    assert r.returncode == 3 and "could not reach any peer" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Failed to open" not in r.stderr

    other_run = RUN[:-1] + "X"
    r = cli(
        "ckpt",
        "pull",
        cid,
        "--from",
        addr(node),
        "--run",
        other_run,
        "--state-dir",
        str(tmp_path / "o"),
    )
    assert r.returncode == 8 and "not of --run" in r.stderr, r.stderr
    assert CheckpointStore(tmp_path / "o").list() == []

    # The only provider serves a chunk that does not match its hash: refused, nothing stored.
    bad = CheckpointStore(Path(node.state_dir)).chunks / manifest.chunks[4]
    bad.write_bytes(b"\x00" * bad.stat().st_size)
    fresh = tmp_path / "fresh"
    r = cli("ckpt", "pull", cid, "--from", addr(node), "--state-dir", str(fresh))
    assert r.returncode == 8, r.stderr
    assert "could not be fetched" in r.stderr and "does not match its hash" in r.stderr
    assert CheckpointStore(fresh).list() == []  # no manifest: the checkpoint is not visible
