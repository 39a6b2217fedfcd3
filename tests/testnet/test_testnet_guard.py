"""The testnet launcher's bookkeeping, without starting nodes: testnets of two directories
train two runs; `up` refuses what the machine cannot hold; every process started is in
testnet.json before the next starts; one testnet command at a time per directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocols import manifest as mf
from testnet import dirlock, launcher
from tests.conftest import REPO


def test_two_testnet_directories_train_two_runs(tmp_path: Path, monkeypatch):
    """Seen: every `up` with the default manifest had one run-id, so testnets of two
    directories merged (mDNS on loopback, a joiner seeing both)."""
    monkeypatch.setattr(launcher, "_spawn", _sleeper)
    monkeypatch.setattr(launcher, "_phase", lambda p: "running")
    try:
        a = launcher.up(tmp_path / "a", 1, detached=True)
        b = launcher.up(tmp_path / "b", 1, detached=True)
        assert a.run_id != b.run_id
        launcher.down(tmp_path / "a")
        again = launcher.up(tmp_path / "a", 1, detached=True)
        assert again.run_id == a.run_id  # the same directory: the same run, it resumes
    finally:
        launcher.down(tmp_path / "a")
        launcher.down(tmp_path / "b")
    m = mf.load_manifest_file(launcher.default_manifest_path())
    long = mf.Manifest.model_validate({**m.model_dump(by_alias=True),
                                       "run": {**m.run.model_dump(), "name": "x" * 64}})
    assert len(launcher.testnet_manifest(long, tmp_path).run.name) <= 64


def test_up_refuses_more_nodes_than_the_machine_holds(tmp_path: Path):
    # (a manifest that does not exist: before the bound, `up` failed on it, starting nothing)
    with pytest.raises(launcher.TestnetError, match=r"holds at most \d+ node processes"):
        launcher.up(tmp_path / "tn", 100_000, manifest=tmp_path / "missing.toml")
    assert not (tmp_path / "tn" / launcher.STATE_FILE).exists()
    most, why = launcher.capacity()
    assert most >= 1 and ("MB available" in why or "processes allowed" in why or "CPUs" in why)


def _sleeper(name: str, state_dir: Path, args: list[str], detached: bool, env: dict,
             topo: object = None, fail_at: list[int] | None = None) -> launcher.Proc:
    """A stand-in node: a real process whose command line names its state dir (as
    launcher.alive checks) and that says it listens at once."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "addrs.json").write_text('{"addrs": ["/ip4/127.0.0.1/tcp/1/p2p/x"]}')
    if fail_at is not None:
        fail_at[0] -= 1
        if fail_at[0] == 0:
            raise launcher.TestnetError(f"cannot start {name}: Resource temporarily "
                                        "unavailable")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(state_dir)],
                         start_new_session=True)
    return launcher.Proc(name, str(state_dir), p.pid, args)


def test_a_start_that_fails_midway_leaves_no_process_behind(tmp_path: Path, monkeypatch):
    """Seen: `--nodes 500` failed at fork (EAGAIN) with 69 nodes running and no
    testnet.json, so `down` said "no testnet running". Each pid is recorded as it starts."""
    started: list[launcher.Proc] = []
    fail_at = [7]  # the bootstrap, then the 6th node: in the third batch of 2

    def spawn(*args, **kwargs):
        p = _sleeper(*args, fail_at=fail_at)
        started.append(p)
        return p

    monkeypatch.setattr(launcher, "_spawn", spawn)
    monkeypatch.setattr(launcher, "batch_size", lambda: 2, raising=False)
    with pytest.raises(launcher.TestnetError, match="cannot start node6"):
        launcher.up(tmp_path / "tn", 8, detached=True)
    assert len(started) == 6
    try:
        assert not any(launcher.alive(p.pid, p.state_dir) for p in started)
    finally:
        for p in started:
            if launcher.alive(p.pid, p.state_dir):
                os.kill(p.pid, 9)
        launcher._reap()


HOLD = """
import sys
from testnet import dirlock, launcher
with dirlock.locked(sys.argv[1]):
    net = launcher.Testnet.load(sys.argv[1])
    net.procs.append(launcher.Proc("node5", sys.argv[1] + "/node5", 1, []))
    net.save()
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_testnet_commands_wait_for_each_other_and_read_testnet_json_afresh(tmp_path: Path):
    """Seen: two concurrent `kill-stage` both named their replacement node5. A command
    waits for the one in progress and then sees what it recorded."""
    d = tmp_path / "tn"
    d.mkdir()
    net = launcher.Testnet(str(d), "QmRun", "/ip4/127.0.0.1/tcp/1/p2p/x",
                           [launcher.Proc("bootstrap", str(d / "bootstrap"), 1, [])], True, 1)
    net.save()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(d)], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(dirlock.DirLocked, match=f"pid {holder.pid}"), \
                dirlock.locked(d, wait_s=0.2):
            pass
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        # `net` was read before the other command added node5: under the lock it is read
        # again, and the name is refused instead of a second node5 being started.
        with pytest.raises(launcher.TestnetError, match="node5 is already part"):
            launcher.add_node(net, "node5")
        assert [p.name for p in net.procs] == ["bootstrap", "node5"]
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_is_reentrant_in_one_process(tmp_path: Path):
    with dirlock.locked(tmp_path), dirlock.locked(tmp_path):
        pass
    with dirlock.locked(tmp_path, wait_s=0.1):  # released: free again
        pass
