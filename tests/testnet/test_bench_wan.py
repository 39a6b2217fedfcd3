"""The WAN benchmark's arithmetic (testnet/bench/wan.py): the target loss every node of
both runs reached, and the report built from statuses. The runs themselves need root and
take minutes: `node bench wan`."""

from __future__ import annotations

from testnet.bench import wan


def test_the_target_is_the_loss_every_node_reached_and_the_report_reads_it():
    a, b = wan.NodeRun("node1"), wan.NodeRun("node1", "diloco")
    a.losses = [(10.0, 3.0), (20.0, 2.5), (30.0, 2.2)]
    b.losses = [(12.0, 3.1), (25.0, 2.6), (40.0, 2.4)]
    assert wan.target_loss([a, b]) == 2.4
    assert a.first_below(2.4) == 30.0 and b.first_below(2.4) == 40.0
    assert wan.target_loss([a, wan.NodeRun("node3")]) is None  # one never evaluated
    a.last = {"training": {"step": 1000, "wall_s": 200.0, "compute_fraction": 0.97,
                           "rounds_averaged": 19, "rounds_local": 1,
                           "bytes_sent": 19 * 12_800_000, "val_loss": 2.4,
                           "params": 6_400_000},
              "averaging": {"exchange_seconds": {"sum": 57.0, "count": 19},
                            "partners": {"x": {"wire_mb_per_s": 20.0}}}}
    b.last = {"training": {"step": 800, "wall_s": 200.0, "compute_fraction": 0.85,
                           "rounds_averaged": 16, "rounds_local": 0, "sync_wait_s": 48.0,
                           "bytes_sent": 32 * 12_800_000, "val_loss": 2.4},
              "averaging": {"exchange_seconds": {"sum": 44.8, "count": 32},
                            "partners": {"x": {"wire_mb_per_s": 19.0},
                                         "y": {"wire_mb_per_s": 21.0}}}}
    text = wan.report([a, b], wan.FULL, "100mbit", 50.0, quick=False)
    assert "| noloco | node1 | 1000 | 97.0% | 19 | 1 | 12.8 | 3.00 | 0.00 | 20.0 | 2.400 | 30 |" \
        in text
    # DiLoCo: 2 swaps a round (25.6 MB), 1.4 s each, 3 s waited per outer step
    assert "| diloco | node1 | 800 | 85.0% | 16 | 0 | 25.6 | 1.40 | 3.00 | 20.0 | 2.400 | 40 |" \
        in text
