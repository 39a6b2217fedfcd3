"""A stage map and a step counter that one bad view cannot throw off (node/pipe/
convergence.py, the pipeline service's takeover and swarm step)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from node.membership.view import Membership
from node.pipe import convergence
from protocols.heartbeat import Heartbeat
from tests.conftest import node_context


def service_hearing(*beats: tuple[str, int, float, dict], me: str = "z0", stage: int = 0,
                    substrate: Any = None):
    """A training pipeline service (the testnet's 4-stage manifest) hosting `stage` as
    `me`, which heard each (peer, stage, seconds ago, more stats) heartbeat, its pieces
    composed over a context of that view (weights fetched over `substrate`)."""
    import node.pipe.service as ps
    from node.pipe.fetch import WeightsFetcher
    from node.training.rounds import TrainingStats
    from protocols import manifest as mf
    from testnet import launcher

    m = mf.load_manifest_file(launcher.scenario_manifest_path("pipeline"))
    service = ps.PipelineService(m, mf.run_id(mf.canonical_bytes(m)), TrainingStats())
    membership = Membership(me, ttl_s=5.0)
    now, wall = time.monotonic(), time.time()
    for seq, (peer, s, ago, more) in enumerate(beats):
        membership.heard(Heartbeat(peer, seq=seq + 1, stats={"t": wall - ago, "stage": s,
                                                             "staged": 1, **more}),
                         now=now - ago, wall=wall)
    ctx = node_context(membership=membership, peer_id=me,
                       config={"peer_ttl_s": 5.0, "heartbeat_s": 1.0},
                       phases=SimpleNamespace(started=now))
    service.compose(ctx, WeightsFetcher(substrate, service.state.run_id))  # type: ignore[arg-type]
    st = service.state
    st.stage, st.training, st.worker = stage, True, object()
    st.stop = threading.Event()
    return service


def test_a_takeover_is_refused_while_the_stage_s_host_was_heard_lately():
    """Stage 1's only host's last heartbeat arrived 7 s ago: past the live view's 5 s ttl
    (a loaded machine delays heartbeats so), so stage 1 looks empty and this node, the
    highest of stage 0's two hosts, is the one placement would move there. It does not
    (issue 27: a stage-0 host took stage 1 over while stage 1's host trained, from the
    seed); once that host has been silent past 15 s, it does."""
    others = [("a0", 0, 0.5, {}), ("c2", 2, 0.5, {}), ("d3", 3, 0.5, {})]
    service = service_hearing(*others, ("b1", 1, 7.0, {}))
    assert service.map.rows()[1] == []
    service.choice.follow_once()
    assert service.state.move_to is None and not service.state.stop.is_set()
    assert service.state.counters["refused: takeover"] == 1

    service = service_hearing(*others, ("b1", 1, 16.0, {}))
    service.choice.follow_once()
    assert service.state.move_to == 1 and service.state.stop.is_set()


def test_a_step_claim_no_trained_peer_confirms_is_not_the_swarm_s():
    trained = {"a", "b", "c", "me"}
    assert convergence.confirmed_step({"a": 251, "b": 250, "c": 7055}, trained) == 251
    assert convergence.confirmed_step({"a": 251, "b": 7054, "c": 7055}, trained) == 7055
    # a trained peer 10 steps behind (a loaded host) confirms; a joiner does not refute
    assert convergence.confirmed_step({"a": 300, "b": 290}, trained) == 300
    assert convergence.confirmed_step({"a": 300, "j": 0}, trained) == 300
    # a stage's only survivor, nobody to check it against: its step stands
    assert convergence.confirmed_step({"a": 300}, trained) == 300
    assert convergence.confirmed_step({}, trained) == 0
    # the service: a runaway first stage is not the step the others jump to
    service = service_hearing(("a0", 0, 0.5, {"step": 7055}), ("b1", 1, 0.5, {"step": 251}),
                              ("c2", 2, 0.5, {"step": 250}))
    service.state.progress.step = 251
    assert service.map.swarm_step() == 251
