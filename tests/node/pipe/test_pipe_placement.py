"""Stage placement and replica routing of live pipeline runs (node/pipe/placement.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from node.ml.pipeline import schedule
from node.pipe import placement as pl
from tests.conftest import REPO, node_context


def test_a_joiner_takes_the_stage_with_the_fewest_live_hosts_lowest_on_ties():
    assert pl.choose({}, 4) == 0
    assert pl.choose({"a": 0}, 4) == 1
    assert pl.choose({"a": 0, "b": 1, "c": 3}, 4) == 2
    assert pl.choose({"a": 0, "b": 1, "c": 2, "d": 3}, 4) == 0
    assert pl.choose({"a": 0, "b": 0, "c": 1, "d": 2, "e": 3}, 4) == 1


def test_the_stage_map_lists_hosts_by_peer_id_and_ignores_bad_claims():
    smap = pl.stage_map({"c": 1, "a": 1, "b": 0, "x": 9, "y": -1, "z": "1"}, 3)  # type: ignore[dict-item]
    assert smap == [["b"], ["a", "c"], []]
    assert not pl.complete(smap)


@pytest.mark.parametrize(("nodes", "stages"), [(4, 4), (8, 4), (6, 3), (5, 4), (3, 2)])
def test_nodes_that_chose_together_move_apart_one_at_a_time(nodes, stages):
    """Everyone saw an empty map and took stage 0; rebalance (each node's own decision
    from the same view) ends in a balanced map, one move per round."""
    hosts = {f"peer{i:02d}": 0 for i in range(nodes)}
    for _ in range(4 * nodes):
        moves = {me: s for me in hosts
                 if (s := pl.rebalance(me, hosts, stages, training=False)) is not None}
        assert len(moves) <= 1  # the same view: exactly one mover
        if not moves:
            break
        hosts.update(moves)
    smap = pl.stage_map(hosts, stages)
    assert pl.balanced(smap) and (pl.complete(smap) or nodes < stages)


def test_once_training_a_node_moves_only_to_a_stage_left_without_host():
    hosts = {"a": 0, "b": 0, "c": 0, "d": 1, "e": 2, "f": 3}
    assert pl.rebalance("c", hosts, 4, training=True) is None  # 3 vs 1: not worth a move
    assert pl.rebalance("c", hosts, 4, training=False) == 1
    del hosts["e"]  # stage 2 lost every host
    assert pl.rebalance("c", hosts, 4, training=True) == 2
    assert pl.rebalance("a", hosts, 4, training=True) is None  # only the highest id moves


def test_routing_without_torch_is_the_schedule_s_routing():
    """The trio thread routes before torch is loaded: placement and the schedule import
    without it, and route like schedule.path on the unswapped path (hop h = stage h)."""
    code = ("import sys; import node.pipe.placement, node.ml.pipeline.schedule; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
    for step in range(5):
        for k in range(4):
            for s in range(3):
                for r in range(3):
                    assert pl.next_replica(7, step, k, s, r, 3, 3, "random") == \
                        schedule.route(7, step, k, s, 3)[r]
            for r in range(3):
                assert pl.last_replica(7, step, k, r, [3, 3, 3, 3], "random") == \
                    schedule.path(7, step, k, 4, 3, r)[-1]
                assert pl.last_replica(7, step, k, r, [3, 3, 3, 3], "fixed") == r
    # CheckFree+'s swapped path has 6 hops over 4 stages: routed per hop.
    counts = [3] * len(schedule.hops((1, 1, 1, 1), 1, True))
    assert pl.last_replica(7, 0, 1, 0, counts, "random") == \
        schedule.path(7, 0, 1, len(counts), 3, 0)[-1]


def test_unequal_replica_counts_spread_over_every_next_replica():
    """One host left where the next stage has two: its micro-batches alternate between
    them (as `replica % there` every one went to the first, and the other froze)."""
    assert [pl.next_replica(0, 0, k, 0, 0, 1, 2, "random") for k in range(4)] == [0, 1, 0, 1]
    assert [pl.next_replica(0, 0, k, 0, r, 2, 1, "random")
            for k in range(2) for r in range(2)] == [0, 0, 0, 0]
    # 2 -> 3 and 3 -> 2: each next replica gets as many of a step's micro-batches
    for here, there in ((2, 3), (3, 2)):
        got = [pl.next_replica(0, 0, k, 0, r, here, there, "random")
               for k in range(6) for r in range(here)]
        assert sorted(got.count(q) for q in range(there)) == [len(got) // there] * there
    assert pl.next_replica(0, 0, 1, 0, 0, 1, 2, "fixed") == 0  # fixed routing stays


def test_a_replacement_on_a_stale_view_moves_before_the_trained_host_beside_it():
    """It took stage 0 while the dead stage 2 host still looked live; once that host is
    gone, the replacement (not yet training) moves, never the trained stage-0 host."""
    hosts = {"zz-trained": 0, "aa-new": 0, "b": 1, "d": 3}
    settled = {"zz-trained", "b", "d"}
    assert pl.rebalance("aa-new", hosts, 4, training=False, settled=settled) == 2
    assert pl.rebalance("zz-trained", hosts, 4, training=True, settled=settled) is None
    # with no unsettled node, the highest id of the fullest stage takes it over
    assert pl.rebalance("zz-trained", {"zz-trained": 0, "aa": 0, "b": 1, "d": 3}, 4,
                        training=True, settled={"zz-trained", "aa", "b", "d"}) == 2


def test_of_two_trained_hosts_the_much_younger_one_takes_the_lost_stage_over():
    hosts = {"zz-old": 0, "aa-young": 0, "b": 1, "d": 3}
    settled = set(hosts)
    uptime = {"zz-old": 900.0, "aa-young": 40.0, "b": 900.0, "d": 900.0}
    assert pl.rebalance("aa-young", hosts, 4, training=True, settled=settled,
                        uptime=uptime) == 2
    assert pl.rebalance("zz-old", hosts, 4, training=True, settled=settled,
                        uptime=uptime) is None
    close = {**uptime, "aa-young": 890.0}  # too close to tell apart across views: by id
    assert pl.rebalance("zz-old", hosts, 4, training=True, settled=settled,
                        uptime=close) == 2


def test_with_checkfree_plus_an_edge_stage_takes_activations_from_its_partner():
    """The service's claim check follows the micro-batch's visits: with the swap, stage 0
    takes micro-batch 1's activations from stage 1 (its blocks' visit) and gradients from
    stage 3; without it, stage 0 takes no activations at all."""
    from node.pipe.routing import Routing
    from node.pipe.stage_map import StageMap
    from node.pipe.state import PipeState
    from node.training.rounds import TrainingStats
    from protocols import manifest as mf
    from protocols import pipeline as pipe

    text = (REPO / "testnet" / "pipeline_manifest.toml").read_text()
    for recovery, swapped in (("checkfree+", True), ("checkfree", False)):
        m = mf.parse_manifest(text.replace('recovery = "checkfree"', f'recovery = "{recovery}"'))
        state = PipeState(m, "run", TrainingStats())
        state.stage = 0
        svc = StageMap(node_context(), state)
        svc.rows = lambda: [["a"], ["b"], ["c"], ["d"]]  # type: ignore[method-assign]

        def header(kind: str, mb: int, hop: int) -> pipe.MessageHeader:
            return pipe.MessageHeader(kind, "run", 0, 1, mb, (1, 1, 1), hop)

        assert ("act" in Routing(node_context(), state, svc).expect().kinds) is swapped
        if swapped:
            assert svc.claim("b", header("act", 1, 2)) is None
            assert svc.claim("d", header("grad", 1, 2)) is None
            assert svc.claim("b", header("grad", 1, 0)) is None
            assert "does not host stage 1" in svc.claim("c", header("act", 1, 2))
            assert "not at stage 0" in svc.claim("b", header("act", 1, 3))
            assert "not at stage 0" in svc.claim("b", header("act", 0, 2))  # even: no swap
        else:
            assert svc.claim("b", header("grad", 1, 0)) is None
            assert "not at stage 0" in svc.claim("b", header("act", 1, 2))


def test_a_heartbeat_a_ttl_older_than_the_freshest_is_no_evidence_of_life(monkeypatch):
    """A replacement joining seconds after a host died hears the dead host's last
    heartbeat from gossip's history among its peers' fresh ones; its stage choice must not
    count it (StageMap.live(first_choice=True)). Heartbeats all held back alike (a
    loaded relay) still count."""
    import time
    from types import SimpleNamespace

    import node.pipe.stage_map as sm
    from node.membership.view import Membership
    from node.pipe.state import PipeState
    from node.training.rounds import TrainingStats
    from protocols import manifest as mf
    from protocols.heartbeat import Heartbeat
    from testnet import launcher

    wall = 1_000_000.0
    monkeypatch.setattr(sm, "time", SimpleNamespace(time=lambda: wall,
                                                    monotonic=time.monotonic))
    m = mf.load_manifest_file(launcher.scenario_manifest_path("pipeline"))
    state = PipeState(m, mf.run_id(mf.canonical_bytes(m)), TrainingStats())
    service = sm.StageMap(node_context(), state)

    def view(*beats: tuple[str, float]) -> list[str]:
        """Who is live after hearing these (peer, written seconds ago) heartbeats now."""
        membership = Membership("me", ttl_s=5.0)
        for peer, ago in beats:
            membership.heard(Heartbeat(peer, seq=1, stats={"t": wall - ago, "stage": 0}),
                             wall=wall)
        service.ctx = node_context(membership=membership, config={"peer_ttl_s": 5.0})
        return sorted(e.peer_id for e in service.live(first_choice=True))

    assert view(("dead", 7.0)) == ["dead"]  # nothing fresher heard yet: it may be alive
    assert view(("dead", 7.0), ("a", 0.5), ("b", 1.0)) == ["a", "b"]
    # every heartbeat 9 s late: none is older than the others
    assert view(("a", 9.0), ("b", 9.0), ("c", 9.0)) == ["a", "b", "c"]
    # once placed, a host whose heartbeats arrive late stays in the map (the ttl on
    # arrival expires a dead one)
    assert sorted(e.peer_id for e in service.live()) == ["a", "b", "c"]
    view(("late", 7.0), ("a", 0.5))
    assert sorted(e.peer_id for e in service.live()) == ["a", "late"]


def test_each_replica_gets_one_of_each_visit_and_a_survivor_gets_the_lost_share():
    paths = [[0, 1, 2]] * 4  # 3 stages in stage order, 4 micro-batches
    for step in range(5):
        # as many hosts everywhere: the route is a permutation, one of each per replica
        assert [pl.arrivals(7, step, paths, [2, 2, 2], "random", s, r)
                for s in (1, 2) for r in (0, 1)] == [4, 4, 4, 4]
        # stage 1 lost a replica: its survivor serves both origins' micro-batches, and
        # hands them on to both stage-2 replicas alike
        assert pl.arrivals(7, step, paths, [2, 1, 2], "random", 1, 0) == 8
        assert [pl.arrivals(7, step, paths, [2, 1, 2], "random", 2, r)
                for r in (0, 1)] == [4, 4]
    # CheckFree+'s swap: micro-batch 1 visits stage 0 a second time (0 -> 1 -> 0 -> 2)
    assert pl.arrivals(7, 0, [[0, 1, 2], [0, 1, 0, 2]], [1, 1, 1], "random", 0, 0) == 1


def test_a_lost_replica_leaves_the_routes_within_a_ttl_and_the_survivor_waits_for_its_share(
        monkeypatch):
    """4 stages x 2 replicas, one stage-1 host silent for longer than the heartbeat ttl:
    the stage map (so the routes and the claims) no longer lists it, and the surviving
    stage-1 host expects both first-stage replicas' micro-batches each step."""
    import time

    from node.membership.view import Membership
    from node.pipe.routing import Routing
    from node.pipe.stage_map import StageMap
    from node.pipe.state import PipeState
    from node.training.rounds import TrainingStats
    from protocols import manifest as mf
    from protocols.heartbeat import Heartbeat
    from testnet import launcher

    m = mf.load_manifest_file(launcher.scenario_manifest_path("pipeline"))
    state = PipeState(m, mf.run_id(mf.canonical_bytes(m)), TrainingStats())
    n, per_step = state.n, state.M
    membership = Membership("s1a", ttl_s=5.0)
    now, wall = time.monotonic(), time.time()
    for peer, stage, ago in [("s0a", 0, 0), ("s0b", 0, 0), ("s1b", 1, 5.5)] + [
            (f"s{s}{x}", s, 0) for s in range(2, n) for x in "ab"]:
        membership.heard(Heartbeat(peer, seq=1, stats={"t": wall, "stage": stage}),
                         now=now - ago, wall=wall)
    ctx = node_context(membership=membership, peer_id="s1a", config={"peer_ttl_s": 5.0})
    state.stage = 1
    stage_map = StageMap(ctx, state)
    smap = stage_map.rows()
    assert smap[1] == ["s1a"] and smap[0] == ["s0a", "s0b"]
    assert Routing(ctx, state, stage_map).arrivals(3) == 2 * per_step
