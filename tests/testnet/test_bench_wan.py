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


def test_the_gpu_case_reports_per_node_shares_and_marks_missing_codecs_pending():
    from testnet.bench import wan_gpu

    codec, why = wan_gpu.compressed_codec("no-such-codec")
    assert codec is None and "no-such-codec" in why
    assert wan_gpu.compressed_codec("topk") == ("topk", None)  # the manifest takes it
    assert wan_gpu.scaled_rate("100mbit", 8) == "12500kbit"
    for bad in ("fast", "100mbps"):
        try:
            wan_gpu.scaled_rate(bad, 2)
        except ValueError as e:
            assert bad in str(e)
        else:
            raise AssertionError(bad)
    r = wan.NodeRun("node1", codec="bf16")
    r.peak_rss_mb = 1700.0
    r.last = {"training": {"step": 4000, "wall_s": 150.0, "compute_s": 143.2,
                           "compute_fraction": 0.955, "outer_s": 3.0, "rounds_averaged": 4,
                           "rounds_local": 1, "span": 16, "bytes_sent": 5 * 172_000_000},
              "averaging": {"exchange_seconds": {"sum": 60.0, "count": 4},
                            "partners": {"x": {"wire_mb_per_s": 22.0}}}}
    assert wan_gpu.row(r) == ["noloco", "bf16", "node1", "4000", "35.8", "95.5%", "2.0%",
                              "4 / 1", "16", "172.0", "15.0", "0.0", "22.0", "1700"]
    assert wan_gpu.row(r, scale=8)[9] == "1376.0 (172.00 measured)"
    pending = wan.NodeRun("node2", codec=wan_gpu.PENDING)
    text = wan_gpu.report([r, pending], 35.8, 150, "100mbit", 50.0, [3.0, 5.0],
                          "protocols/codecs.py knows no compressed codec yet", scale=8)
    assert f"| noloco | {wan_gpu.PENDING} | node2 |" in text
    assert "load average 3.0-5.0" in text and "12500kbit" in text
