"""Checkpoints: content-addressed, verified, atomic under SIGKILL and a full disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import torch

from node.checkpoints.store import CheckpointError, CheckpointStore
from protocols import checkpoint as ck
from protocols.errors import RemoteProtocolError
from tests.conftest import REPO, wait_until

RUN = "Qmf3x5zkVshbXGLWkZM6tigievvtjHPyP1UH8bNqpTjJpW"


def tensors(n: int = 1000, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": torch.tensor([seed])}


def test_round_trip_verify_and_retention(tmp_path: Path):
    store = CheckpointStore(tmp_path)
    cids = [store.save(RUN, step, tensors(300_000, step)) for step in (10, 20, 30)]
    assert store.latest(RUN) == cids[-1]
    manifest, loaded = store.load(cids[-1])
    assert manifest.step == 30 and torch.equal(loaded["w"], tensors(300_000, 30)["w"])
    assert store.verify(cids[0]) == []
    store.retain(RUN, keep=2)
    assert [c for c, _ in store.list(RUN)] == cids[1:]


def test_a_corrupt_chunk_is_never_loaded(tmp_path: Path):
    store = CheckpointStore(tmp_path)
    cid = store.save(RUN, 1, tensors())
    chunk = store.chunks / store.manifest(cid).chunks[0]
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert "corrupt" in store.verify(cid)[0]
    with pytest.raises(CheckpointError, match="fails verification"):
        store.load(cid)
    with pytest.raises(RemoteProtocolError):
        store.put_chunk(store.manifest(cid).chunks[0], bytes(data))


def test_a_pulled_checkpoint_is_hashed_once_on_its_way_to_the_trainer(tmp_path: Path,
                                                                      monkeypatch):
    """A joiner verifies each chunk as it arrives (`put_chunk`) and loads it at once: the
    load does not hash it again; a later load, or a chunk cut short since, is checked."""
    writer = CheckpointStore(tmp_path / "writer")
    cid = writer.save(RUN, 1, tensors(3_000_000))  # 3 chunks
    m = writer.manifest(cid)
    joiner = CheckpointStore(tmp_path / "joiner")
    for digest in m.chunks:
        joiner.put_chunk(digest, (writer.chunks / digest).read_bytes())
    joiner.put_manifest(cid, m.encode())
    hashed: list[int] = []
    real = ck.sha256_hex
    monkeypatch.setattr(ck, "sha256_hex", lambda data: hashed.append(len(data)) or real(data))
    assert torch.equal(joiner.load(cid)[1]["w"], tensors(3_000_000)["w"])
    assert hashed == []
    joiner.load(cid)
    assert len(hashed) == len(m.chunks)  # once loaded, trusted no more

    joiner.put_chunk(m.chunks[1], (writer.chunks / m.chunks[1]).read_bytes())
    (joiner.chunks / m.chunks[1]).write_bytes(b"cut short")
    with pytest.raises(CheckpointError, match=r"chunk 1 .* is corrupt"):
        joiner.load(cid)


@pytest.mark.parametrize("doc,reason", [
    ({"size": 2**50}, "absurd"),
    ({"size": 10 << 20, "chunks": ["0" * 64]}, "need 3 chunks"),
    ({"chunk": 1}, "absurd"),
    ({"chunks": ["zz"]}, "sha256"),
])
def test_manifests_with_absurd_sizes_are_refused(doc, reason):
    good = ck.build(RUN, 1, 0, b"x" * 100).encode()
    bad = {**msgpack.unpackb(good), **doc}
    with pytest.raises(RemoteProtocolError, match=reason):
        ck.decode(msgpack.packb(bad))
    with pytest.raises(RemoteProtocolError, match="hashes to"):
        ck.decode(good, expected_cid=ck.cid_of(good + b"x"))


WRITER = textwrap.dedent("""
    import resource, signal, sys, torch
    from node.checkpoints.store import CheckpointStore, CheckpointError
    store = CheckpointStore(sys.argv[1])
    store.save("%s", 1, {"w": torch.ones(1000)})
    print("first saved", flush=True)
    if sys.argv[2] == "full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # a "disk" of 1 MiB files
    try:
        store.save("%s", 2, {"w": torch.randn(20_000_000)})   # 80 MB, 20 chunks
    except CheckpointError as e:
        print("refused:", e, flush=True)
""") % (RUN, RUN)


def test_a_full_disk_fails_the_save_cleanly(tmp_path: Path):
    r = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), "full"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert "refused:" in r.stdout and "earlier checkpoints are intact" in r.stdout, r.stderr
    store = CheckpointStore(tmp_path)
    assert [m.step for _, m in store.list(RUN)] == [1]
    assert store.verify(store.latest(RUN)) == []
    assert not list(store.chunks.glob(".*tmp*"))  # no half-written temp files left


def test_sigkill_in_the_middle_of_a_save_leaves_a_valid_store(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "kill"], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "first saved" in proc.stdout.readline()
        store = CheckpointStore(tmp_path)
        wait_until(lambda: len(list(store.chunks.iterdir())) >= 3, 60, "the second save to start")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    store = CheckpointStore(tmp_path)
    good = store.list(RUN)
    assert [m.step for _, m in good] in ([1], [1, 2])  # the kill may land after the manifest
    for cid, _ in good:
        assert store.verify(cid) == []
    store.retain(RUN, keep=5)  # orphan chunks and temp files of the killed save go away
    assert all(not p.name.startswith(".") for p in store.chunks.iterdir())
