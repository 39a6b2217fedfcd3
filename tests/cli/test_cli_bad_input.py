"""Every CLI command fed bad values: a one-line `error:` and the documented exit code, never a
traceback. Then real node processes: clean stops, the state-directory lock, failures a user
sees. Exit codes: docs/operator.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from node.process.priority import SESSION_NICE_ENV, TRAINER_NICE, session_nice
from node.status.control import query_control
from protocols import manifest as mf
from testnet import launcher
from tests.conftest import FAST_RUN, REPO, cli, run_cli, shared_testnet, wait_until

RUN = mf.run_id(b"no such run")
CID = "QmV5uCatEhFTiiheNrcwqYx3eEPCvWgFt68pxHjVDgz2hx"
DEFAULT_MANIFEST = str(launcher.default_manifest_path())


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "binary.dat").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 200)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "typo.toml").write_text('schema = 1\n[run]\nname = "x"\n[model]\nd_modle = 3\n')
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "unknown.toml").write_text("[join]\ndevise = 'cpu'\n")
    (tmp_path / "broken.toml").write_text("[join\n")
    return tmp_path


# (argv, exit code, text the error line must contain); {t} is the test's tmp_path
CASES = [
    (["join", "Qm[/]"], 2, "Qm[/]"),
    (["join", "not-a-run"], 2, "not a peertrain run-id"),
    (["join", RUN, "--state-dir", "/proc/x"], 6, "cannot use state directory /proc/x"),
    (["join", RUN, "--state-dir", "{t}/afile"], 6, "not a directory"),
    (["join", RUN, "--join-timeout", "-1"], 2, "--join-timeout -1"),
    (["join", RUN, "--join-timeout", "nan"], 2, "--join-timeout nan"),
    (["join", RUN, "--join-timeout", "soon"], 2, "--join-timeout"),
    (["join", RUN, "--heartbeat-target", "0"], 2, "--heartbeat-target 0: expected"),
    (["join", RUN, "--heartbeat-target", "inf"], 2, "--heartbeat-target inf"),
    (["join", RUN, "--want-peers", "-1"], 2, "--want-peers -1: expected"),
    (["join", RUN, "--want-peers", "8", "--max-peers", "4"], 2,
     "--max-peers 4: expected at least --want-peers (8)"),
    (["join", RUN, "--max-peers", "many"], 2, "--max-peers"),
    (["join", RUN, "--rundoc-horizon", "0"], 2, "--rundoc-horizon 0: expected"),
    (["join", RUN, "--listen", "0.0.0.0:4001"], 2, "--listen 0.0.0.0:4001: not a multiaddr"),
    (["join", RUN, "--listen", "/ip4/0.0.0.0/udp/4001"], 2, "expected /ip4/ADDR/tcp/PORT"),
    (["join", RUN, "--listen", "/ip4/192.0.2.1/tcp/0"], 2, "cannot listen there"),
    (["join", RUN, "--device", "tpu"], 2, "--device tpu"),
    (["join", RUN, "--device", "cuda:x"], 2, "--device cuda:x"),
    (["join", RUN, "--attack", "[bold]x"], 2, "--attack [bold]x"),
    (["join", RUN, "--log-level", "loud"], 2, "--log-level loud"),
    (["join", RUN, "--data", "{t}/missing.txt"], 2, "no such file"),
    (["join", RUN, "--data", "{t}/binary.dat"], 2, "binary data"),
    (["join", RUN, "--data", "{t}/latin1.txt"], 2, "not UTF-8 text"),
    (["join", RUN, "--data", "{t}/empty.txt"], 2, "empty"),
    (["join", RUN, "--data", "{t}/emptydir"], 2, "holds no files"),
    (["join", RUN, "--data", "{t}/typo.toml", "--no-train"], 2, "--no-train"),
    (["join", RUN, "--bogus"], 2, "--bogus"),
    (["join"], 2, "Missing argument"),
    (["bootstrap", "--listen", "nowhere"], 2, "--listen nowhere"),
    (["bootstrap", "--state-dir", "{t}/afile"], 6, "not a directory"),
    (["run", "show", "{t}/missing.toml"], 2, "cannot read"),
    (["run", "show", "{t}/typo.toml"], 2, "in [model] (did you mean 'd_model'?)"),
    (["run", "create", "{t}/missing.toml"], 2, "cannot read"),
    (["run", "create", DEFAULT_MANIFEST, "--state-dir", "{t}/afile"], 6,
     "cannot use state directory"),
    (["status", "--state-dir", "{t}/emptydir"], 1, "no node is running"),
    (["testnet", "up", "--manifest", "{t}/missing.toml", "--dir", "{t}/tn"], 2, "cannot read"),
    (["testnet", "up", "--manifest", "{t}/typo.toml", "--dir", "{t}/tn"], 2, "[model]"),
    (["testnet", "up", "-n", "0", "--dir", "{t}/tn"], 2, "--nodes 0"),
    (["testnet", "up", "--heartbeat-target", "-1", "--dir", "{t}/tn"], 2,
     "--heartbeat-target -1: expected"),
    (["testnet", "up", "--scenario", "moon", "--dir", "{t}/tn"], 2, "--scenario moon"),
    (["testnet", "up", "--stages", "4", "--dir", "{t}/tn"], 2, "add --scenario pipeline"),
    (["testnet", "up", "--scenario", "pipeline", "--stages", "1", "--dir", "{t}/tn"], 2,
     "--stages 1 --replicas 1"),
    (["testnet", "kill-stage", "2", "--dir", "{t}/tn"], 1, "no testnet in"),
    (["testnet", "up", "--aggregator", "avg", "--dir", "{t}/tn"], 2, "--aggregator avg"),
    (["testnet", "status", "--dir", "{t}/tn"], 1, "no testnet in"),
    (["testnet", "logs", "-n", "0", "--dir", "{t}/tn"], 2, "--lines 0"),
    (["ckpt", "verify", "Qm[/]"], 2, "not a checkpoint id: 'Qm[/]'"),
    (["ckpt", "verify", ""], 2, "not a checkpoint id"),
    (["ckpt", "pull", "x", "--from", "y"], 2, "not a checkpoint id"),
    (["ckpt", "pull", CID, "--timeout", "-1"], 2, "--timeout -1"),
    (["ckpt", "pull", CID, "--state-dir", "{t}/s"], 2, "say where to pull from"),
    (["ckpt", "pull", CID, "--from", "localhost:1", "--state-dir", "{t}/s"], 2,
     "not a peer multiaddr"),
    (["bench", "nosuch"], 2, "No such command"),
    # config file, tickets, bootstrap sources (docs/operator.md, "Finding peers")
    (["join", RUN, "--config", "{t}/unknown.toml"], 2,
     "{t}/unknown.toml: join.devise: unknown key 'devise' in [join] (did you mean 'device'?)"),
    (["join", RUN, "--config", "{t}/broken.toml"], 2, "{t}/broken.toml: invalid TOML"),
    (["join", RUN, "--config", "{t}/missing.toml"], 2, "cannot read config file"),
    (["bootstrap", "--config", "{t}/unknown.toml", "--listen", "/ip4/127.0.0.1/tcp/0"], 2,
     "unknown key 'devise'"),
    (["config", "show", "--config", "{t}/unknown.toml"], 2, "join.devise: unknown key"),
    (["join", "pt2abc"], 2, "not a ticket: unsupported ticket version 'pt2'"),
    (["join", "pt1abc"], 2, "not a ticket: damaged ticket"),
    (["join", RUN, "--announce", "1.2.3.4:4101"], 2, "--announce 1.2.3.4:4101: expected"),
    (["join", RUN, "--bootstrap", "/ip4/1.2.3.4/tcp/1"], 2,
     "--bootstrap /ip4/1.2.3.4/tcp/1: not a peer multiaddr"),
    (["run", "ticket", RUN, "--state-dir", "{t}/emptydir"], 1, "no node is running"),
    (["join", RUN, "--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0", "--state-dir", "{t}/n"],
     3, f"no bootstrap peer is known for run {RUN}: pass --bootstrap MULTIADDR"),
]


@pytest.mark.parametrize(("argv", "code", "says"), CASES,
                         ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_values_get_one_line_and_the_documented_exit_code(files, argv, code, says):
    argv = [a.replace("{t}", str(files)) for a in argv]
    r = cli(*argv, timeout=60)
    lines = [line for line in r.stderr.strip().splitlines()
             if not line[:8].replace(":", "").isdigit()]  # log lines of a node that started
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr + r.stdout and "unexpected" not in r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert says.replace("{t}", str(files)) in lines[0]
    assert not (files / "s").exists()  # a refused command wrote nothing


# -- real node processes ----------------------------------------------------------------------


def start_join(net: launcher.Testnet, state_dir: Path, *extra: str,
               own_session: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop(SESSION_NICE_ENV, None)  # the product's default, which the suite turns off
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "join", net.run_id, "--bootstrap", net.bootstrap_addr,
         "--listen", launcher.LOOPBACK, "--state-dir", str(state_dir), "--device", "cpu",
         *extra], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=own_session)


def step(state_dir: Path) -> int:
    try:
        return (query_control(state_dir, timeout=2.0).get("training") or {}).get("step", 0)
    except Exception:
        return 0


#: Testnets of one node that does not train, each shared by the tests below that join it
#: or point at it (every joiner has a state directory of its own): the fast run's, for
#: joiners that train, and the default run's.
fast_net = shared_testnet(1, FAST_RUN, extra_node_args=["--no-train"])
idle_net = shared_testnet(1, extra_node_args=["--no-train"])


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_a_training_node_stops_cleanly(fast_net, tmp_path, sig, code):
    """Ctrl-C in a terminal (the node shares the terminal's session), SIGTERM from a
    service manager (a session of its own). Training lowers the session's CPU priority
    only when the session is the node's own (node/process/priority.py)."""
    net = fast_net
    state = tmp_path / "trainer"
    own_session = sig == signal.SIGTERM
    p = start_join(net, state, own_session=own_session)
    try:
        wait_until(lambda: step(state) >= 3 or p.poll() is not None, 120, "training steps")
        assert p.poll() is None, p.stderr.read() if p.stderr else ""
        ours = session_nice()
        if ours is not None:
            theirs = session_nice(Path(f"/proc/{p.pid}/autogroup"))
            assert theirs == (TRAINER_NICE if own_session else ours)
            assert session_nice() == ours
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err[-2000:]
    assert "terminate called" not in err and "Traceback" not in err, err[-2000:]
    assert not (state / "control.json").exists()


@pytest.mark.slow
def test_a_second_node_on_a_live_state_directory_is_refused(idle_net):
    net = idle_net
    node = next(p for p in net.procs if p.name == "node1")
    state = Path(node.state_dir)
    before = {name: (state / name).read_bytes() for name in ("addrs.json", "control.json")}
    stamps = {name: (state / name).stat().st_mtime_ns for name in before}
    for argv in (["join", net.run_id, "--bootstrap", net.bootstrap_addr, "--no-train",
                  "--listen", launcher.LOOPBACK], ["bootstrap", "--listen", launcher.LOOPBACK]):
        r = run_cli(*argv, "--state-dir", str(state), timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 6, r.stderr
        assert len(lines) == 1 and f"a node is running there (pid {node.pid})" in lines[0]
    assert {n: (state / n).read_bytes() for n in before} == before
    assert {n: (state / n).stat().st_mtime_ns for n in before} == stamps
    assert query_control(state)["phase"] == "running"
    r = run_cli("status", "--state-dir", str(state), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["peer_id"] == json.loads(
        before["addrs.json"])["peer_id"]


@pytest.mark.slow
def test_data_shorter_than_the_context_is_refused_before_joining(idle_net, tmp_path):
    net = idle_net
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a few bytes of text\n" * 20)  # 400 bytes: the demo's context is 128
    r = run_cli("join", net.run_id, "--bootstrap", net.bootstrap_addr, "--listen",
                launcher.LOOPBACK, "--state-dir", str(tmp_path / "n"), "--data", str(tiny),
                "--device", "cpu", timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert lines[-1].startswith(f"error: --data {tiny}: 400 bytes leave the validation split")
    assert "128-byte contexts" in lines[-1] and "Traceback" not in r.stderr


def broken_model():  # model.factory of the run below: the trainer fails as it starts
    raise RuntimeError("this model cannot be built")


@pytest.mark.slow
def test_a_trainer_that_fails_stops_the_node_with_the_reason(testnet_factory, tmp_path):
    manifest = tmp_path / "broken.toml"
    manifest.write_text(FAST_RUN.replace(
        '[model]\n', '[model]\nfactory = "tests.cli.test_cli_bad_input:broken_model"\n'))
    net = testnet_factory(1, manifest=manifest, extra_node_args=["--no-train"])
    state = tmp_path / "n"
    p = start_join(net, state)
    try:
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 9, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: training stopped: FactoryError")
    assert "this model cannot be built" in err and "Traceback" not in err
    log = [json.loads(line) for line in (state / "node.log").read_text().splitlines()]
    assert any(e["level"] == "error" and "training stopped" in e["msg"] for e in log)
