"""The timed stand-in trainer (node/training/timed.py): real-size vectors that move like
training, and the environment switch that selects it."""

from __future__ import annotations

import math

import pytest
import torch

from node.training import timed


def test_every_value_moves_by_the_measured_drift_and_noise_of_the_steps_taken():
    n = 3 * (1 << 20) + 5  # several buffer lengths and a ragged end
    t = timed.TimedTrainer(n, 1e-4, seed=1, replica=7)
    start = t.parameters_vector()
    k = 16
    for _ in range(k):
        s = t.step()
    assert s.step == t.step_count == k
    after = t.parameters_vector()
    moved = after - start
    # every value moved (one may stay put where drift and noise cancel below an ulp)
    assert (moved != 0).float().mean().item() > 0.9999
    # k steps: drift·k plus noise·√k, per value
    expected = math.sqrt((timed.DRIFT * k) ** 2 + timed.NOISE ** 2 * k)
    assert moved.pow(2).mean().sqrt().item() == pytest.approx(expected, rel=0.05)
    assert torch.equal(t.parameters_vector(), after)  # no step, no motion


def test_nodes_share_the_initial_weights_and_drift_apart():
    a = timed.TimedTrainer(1000, 1e-4, seed=3, replica=1)
    b = timed.TimedTrainer(1000, 1e-4, seed=3, replica=2)
    assert torch.equal(a.parameters_vector(), b.parameters_vector())
    a.step(), b.step()
    assert not torch.equal(a.parameters_vector(), b.parameters_vector())
    b.set_parameters_vector(a.parameters_vector())
    assert torch.equal(a.parameters_vector(), b.parameters_vector())
    with pytest.raises(ValueError, match="expected a vector of 1000"):
        a.set_parameters_vector(torch.zeros(999))


def test_the_environment_switch_and_the_model_size(monkeypatch):
    monkeypatch.delenv(timed.ENV, raising=False)
    assert timed.from_env() is None
    monkeypatch.setenv(timed.ENV, "35.8")
    assert timed.from_env() == (35.8, None)
    monkeypatch.setenv(timed.ENV, "26.7,10744512")
    assert timed.from_env() == (26.7, 10744512)
    for bad in ("fast", "0", "-3", "35.8,x", "35.8,0"):
        monkeypatch.setenv(timed.ENV, bad)
        with pytest.raises(ValueError, match=timed.ENV):
            timed.from_env()
    from protocols import manifest as mf

    m = mf.parse_manifest(b'schema = 1\n[run]\nname = "x"\n[model]\nd_model = 768\nn_layers = 12\n'
                 b'n_heads = 12\ncontext = 1024\n')
    assert timed.model_params(m) == 85_956_096  # the "86M"


def test_a_step_that_overslept_is_made_up_by_the_next(monkeypatch):
    """Steps keep the device's pace on average even where the host wakes a sleeper late."""
    clock = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(round(s, 6))
        clock[0] += s + (0.1 if len(slept) == 1 else 0.0)  # the first wake-up 100 ms late

    monkeypatch.setattr(timed.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(timed.time, "sleep", sleep)
    t = timed.TimedTrainer(10, 0.04)
    for _ in range(5):
        t.step()
    # 0.14 s for the first; the next two owe it (no sleep, then 0.02), then the pace
    assert slept == [0.04, 0.02, 0.04]
    assert clock[0] == pytest.approx(5 * 0.04)
