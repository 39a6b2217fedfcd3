"""torch loads in the background (node/process/preload.py): the CLI and the daemon's modules import
no torch, a joiner connects, discovers and hears its peers while torch cannot load, then
trains once it can; `--device cuda` without CUDA is refused before anything is dialed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from protocols import manifest as mf
from testnet import launcher
from tests.conftest import FAST_RUN, REPO, run_cli, shared_testnet, status, wait_until

NO_TORCH = """
import sys
import {modules}
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


@pytest.mark.parametrize("modules", ["cli.main", "node.daemon", "node.training.build",
                                     "node.checkpoints.service", "node.ml.device"])
def test_the_cli_and_the_daemons_pre_join_modules_import_no_torch(modules):
    r = subprocess.run([sys.executable, "-c", "import json\n" + NO_TORCH.format(modules=modules)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")
def test_device_cuda_without_cuda_is_refused_before_the_bootstrap_dial(tmp_path):
    # A bootstrap address nobody listens on: a dial would fail with exit 3 instead.
    unreachable = ("/ip4/127.0.0.1/tcp/9/p2p/"
                   "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo")
    run_id = mf.run_id(b"a run nobody serves")
    r = run_cli("join", run_id, "--device", "cuda", "--bootstrap", unreachable,
                "--state-dir", str(tmp_path / "state"))
    assert r.returncode == 10, r.stderr
    assert r.stderr.startswith("error: --device cuda: device 'cuda' requested but"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "state").exists()  # nothing started, nothing written


# The joiner below runs with an import hook that holds the execution of torch's package
# until a file exists (in exec_module: a finder runs under Python's global import lock,
# and waiting there would hold every import of every thread, not just torch's).
GATED = """
import importlib.abc, importlib.machinery, os, sys, time
GATE = os.environ["PEERTRAIN_TEST_TORCH_GATE"]

class Held:
    def __init__(self, real):
        self.real = real
    def __getattr__(self, name):
        return getattr(self.real, name)
    def create_module(self, spec):
        return self.real.create_module(spec)
    def exec_module(self, module):
        while not os.path.exists(GATE):
            time.sleep(0.05)
        self.real.exec_module(module)

class HoldTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = Held(spec.loader)
        return spec

sys.meta_path.insert(0, HoldTorch())
from cli.main import app
app()
"""



def start_gated_joiner(net: launcher.Testnet, tmp_path: Path
                       ) -> tuple[subprocess.Popen, launcher.Proc, Path]:
    """A joiner whose torch import waits for the gate file; (process, Proc, gate)."""
    gate, state = tmp_path / "torch-may-load", tmp_path / "joiner"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PEERTRAIN_TEST_TORCH_GATE": str(gate)}
    with (tmp_path / "joiner.out").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", GATED, "join", net.run_id, "--bootstrap",
             net.bootstrap_addr, "--listen", launcher.LOOPBACK, "--state-dir", str(state)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, launcher.Proc("joiner", str(state), proc.pid), gate


def wait_for_torch_gate(proc: subprocess.Popen, joiner: launcher.Proc, tmp_path: Path) -> dict:
    def waiting_for_torch() -> dict:
        st = status(joiner)
        if proc.poll() is not None:
            raise AssertionError(f"the joiner exited with {proc.returncode}: "
                                 f"{(tmp_path / 'joiner.out').read_text()[-2000:]}")
        heard = (st.get("membership") or {}).get("peers")
        return st if st.get("phase") == "loading torch" and heard else {}

    return wait_until(waiting_for_torch, 180, "the joiner to hear its peer and wait for torch")


#: The run both joiners below join (each a state directory of its own): one testnet start.
net = shared_testnet(1, FAST_RUN, timeout=180)


@pytest.mark.slow
def test_a_joiner_connects_and_hears_peers_before_torch_loads_then_trains(net,
                                                                         tmp_path: Path):
    proc, joiner, gate = start_gated_joiner(net, tmp_path)
    try:
        st = wait_for_torch_gate(proc, joiner, tmp_path)
        assert st["torch_import"]["done"] is False
        assert {"connecting", "discovering", "syncing state"} <= set(st["phase_times"])
        assert "training" not in st  # no torch-using service was built yet

        gate.touch()

        def first_step() -> dict:
            st = status(joiner)
            return st if "first step" in st.get("phase_times", {}) else {}

        st = wait_until(first_step, 180, "the joiner's first step once torch may load")
        assert st["torch_import"]["done"] is True and st["torch_import"]["error"] is None
        assert st["training"]["step"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.slow
def test_a_joiner_stopped_while_torch_loads_exits_at_once(net, tmp_path: Path):
    """Its trainer is built in the background once torch is in (node/training/build.py,
    `Prebuild`); a stop before that must not wait for torch, which here never loads."""
    proc, joiner, _ = start_gated_joiner(net, tmp_path)
    try:
        wait_for_torch_gate(proc, joiner, tmp_path)
        proc.terminate()
        assert proc.wait(timeout=60) == 0, (tmp_path / "joiner.out").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
