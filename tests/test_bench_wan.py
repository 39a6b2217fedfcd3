"""The WAN benchmark's arithmetic (testnet/bench/wan.py): DiLoCo's all-reduce cost from
measured swaps, the target loss every node reached, and the report built from statuses.
The run itself needs root and takes minutes: `node bench wan`."""

from __future__ import annotations

import pytest

from testnet.bench import wan


def test_diloco_waits_log2_nodes_swaps_per_outer_step():
    cost = wan.diloco_cost(step_s=0.1, inner_steps=50, exchange_s=2.5, nodes=4)
    assert cost["wait_s"] == pytest.approx(5.0)  # 2 swaps one after the other
    assert cost["compute_share"] == pytest.approx(5.0 / 10.0)
    assert wan.diloco_cost(0.1, 50, 2.5, nodes=8)["wait_s"] == pytest.approx(7.5)
    assert wan.diloco_cost(0.1, 50, 2.5, nodes=2)["wait_s"] == pytest.approx(2.5)


def test_the_target_is_the_loss_every_node_reached_and_the_report_reads_it():
    a, b = wan.NodeRun("node1"), wan.NodeRun("node2")
    a.losses = [(10.0, 3.0), (20.0, 2.5), (30.0, 2.2)]
    b.losses = [(12.0, 3.1), (25.0, 2.6), (40.0, 2.4)]
    assert wan.target_loss([a, b]) == 2.4
    assert a.first_below(2.4) == 30.0 and b.first_below(2.4) == 40.0
    assert wan.target_loss([a, wan.NodeRun("node3")]) is None  # one never evaluated
    for run in (a, b):
        run.last = {"training": {"step": 1000, "wall_s": 200.0, "compute_fraction": 0.97,
                                 "rounds_averaged": 19, "rounds_local": 1,
                                 "bytes_sent": 19 * 12_800_000, "val_loss": 2.4,
                                 "params": 6_400_000},
                    "averaging": {"exchange_seconds": {"sum": 57.0, "count": 19},
                                  "partners": {"x": {"wire_mb_per_s": 20.0}}}}
    text = wan.report([a, b], wan.FULL, "100mbit", 50.0, quick=False)
    assert "| node1 | 1000 | 97.0% | 19 | 1 | 12.8 | 3.00 | 20.0 | 2.400 | 30 |" in text
    # a bf16 swap of 6.4M values both ways at 20 MB/s: 1.28 s, one per outer step with two
    # nodes; 9.7 s of compute per outer step; each 0.2 s step 0.0256 s longer: 34 s
    assert "| node1 | 1.28 | 1.28 | 88.3% | 34 |" in text
