"""Logs that cannot be flooded (node/status/logs.py PeerFlood)."""

from __future__ import annotations

import logging

from node.status.logs import PeerFlood


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _record(msg: str, t: float, peer: str | None = "12D3bad", reason: str = "junk"):
    r = logging.LogRecord("test.flood", logging.WARNING, __file__, 1, msg, None, None)
    r.created = t
    if peer is not None:
        r.peer, r.reason = peer, reason
    return r


def test_a_flood_is_cut_to_a_burst_and_a_summary():
    flood, out = PeerFlood(burst=3, window_s=60), Collect()
    out.addFilter(flood)
    logger = logging.getLogger("test.flood")
    logger.addHandler(out)
    logger.propagate = False
    try:
        for i in range(615):
            out.handle(_record(f"refused {i}", 1000 + i * 0.05))
        out.handle(_record("other peer", 1001, peer="12D3other"))
        out.handle(_record("no peer", 1001, peer=None))
        assert len(out.lines) == 5
        flood.flush(1000 + 61)
        assert out.lines[-1] == "... 612 more from 12D3bad (junk) in 60 s"
        assert flood.statistics()["suppressed"] == {"junk": 612}
        out.handle(_record("after the window", 1100))  # a new window: written again
        assert out.lines[-1] == "after the window"
    finally:
        logger.removeHandler(out)
        logger.propagate = True


def test_one_decision_per_record_for_every_handler():
    flood, a, b = PeerFlood(burst=1), Collect(), Collect()
    a.addFilter(flood)
    b.addFilter(flood)
    for i in range(3):
        r = _record(f"x{i}", 10.0 + i)
        a.handle(r)
        b.handle(r)
    assert a.lines == b.lines == ["x0"]
    assert flood.suppressed["junk"] == 2


def test_py_libp2p_errors_go_to_node_log_not_the_terminal(tmp_path):
    """py-libp2p logs routine swarm events at ERROR ("fail to upgrade mux for peer ...")
    through a logger without handlers: Python's last-resort handler printed them raw on a
    joiner's terminal. In a fresh interpreter, as `node join` sets logging up."""
    import json
    import subprocess
    import sys

    code = ("import logging, sys, libp2p\n"
            "from node.status.logs import setup_logging\n"
            "setup_logging(__import__('pathlib').Path(sys.argv[1]))\n"
            "logging.getLogger('libp2p.network.swarm').error('fail to upgrade mux for peer X')\n"
            "chatty = logging.getLogger('libp2p.network.auto_connector')\n"
            "chatty.setLevel(logging.INFO)\n"  # as py-libp2p sets some of its loggers
            "chatty.info('initiating 193 new dials')\n"
            "logging.getLogger('node').warning('ours')\n"
            "logging.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, check=True, timeout=120)
    assert "ours" in out.stderr and "fail to upgrade mux" not in out.stderr
    logged = [json.loads(line)["msg"] for line in (tmp_path / "node.log").read_text().splitlines()]
    assert logged == ["fail to upgrade mux for peer X", "ours"]
