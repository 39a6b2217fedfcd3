"""What node.log keeps of py-libp2p's loggers (node/status/logs.py setup_logging)."""

from __future__ import annotations

import json
import logging

import pytest

from node.status.logs import LOG_FILE, THIRD_PARTY, setup_logging


@pytest.fixture
def node_logging(tmp_path):
    """setup_logging into tmp_path; the process's logging as it was afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level,
             {n: (logging.getLogger(n).level, logging.getLogger(n).propagate)
              for n in THIRD_PARTY})
    setup_logging(tmp_path, stderr=False)
    try:
        yield tmp_path / LOG_FILE
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        handlers, level, third = saved
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        for name, (lvl, propagate) in third.items():
            logging.getLogger(name).setLevel(lvl)
            logging.getLogger(name).propagate = propagate


def test_node_log_keeps_libp2p_errors_but_not_the_routine_ones(node_logging):
    swarm = logging.getLogger("libp2p.network.swarm")
    swarm.error("fail to upgrade mux for peer %s", "12D3KooWprobe")  # a dial-back's end
    logging.getLogger("libp2p.transport.tcp.tcp").error(  # a peer that left
        "Failed to open TCP stream: %s", "all attempts to connect to 127.0.0.1:9 failed")
    swarm.warning("a hiccup")  # below ERROR: not kept
    swarm.error("listener failed: %s", "address in use")
    swarm.error({"unhashable": "message"})  # any object may be a record's msg
    logging.getLogger("node.test").info("ours")
    for handler in logging.getLogger().handlers:
        handler.flush()
    lines = [json.loads(line)["msg"] for line in node_logging.read_text().splitlines()]
    assert lines == ["listener failed: address in use", "{'unhashable': 'message'}", "ours"]
