"""`node bench soak --quick`: a real bootstrap process takes 400 connections from 40
identities (past py-libp2p's 250 inbound slots, which it used to keep until the host
stopped), then a fresh peer connects; the section lands in the given doc. No timing
assertions: the numbers are the benchmark's (docs/benchmarks.md, section soak)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testnet.bench import soak


@pytest.mark.slow  # one bootstrap process
def test_quick_soak_takes_400_connections_and_a_fresh_peer_still_gets_in(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    text = soak.main(quick=True, doc=doc)
    assert "400 connections (0 failed)" in text
    assert re.search(r"a peer the node never saw connected and pinged in \d+ ms", text)
    rows = [line.split("|") for line in text.splitlines() if re.match(r"\| [\d,]+", line)]
    assert len(rows) >= 10 and all(r[7].strip() == "0" for r in rows)  # nothing refused
    assert rows[-1][6].strip() == "0"  # every slot came back
    assert "<!-- bench:soak:start -->" in doc.read_text()
