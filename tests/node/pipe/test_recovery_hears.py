"""A stage's recovery reads the swarm's step and picks its rule only once it has heard
every host that renews a stage claim (node/pipe/recovery.py `_hear_hosts`), or its bound
passed: on trio's autojump clock, no waiting."""

from __future__ import annotations

import time

import trio
import trio.testing

from node.pipe.claims import StageLease
from node.pipe.recovery import HEAR_TTLS
from node.run.rundoc_sync import now_ms
from protocols.heartbeat import Heartbeat
from protocols.keys import Signer
from protocols.rundoc import RunDocument
from tests.node.pipe.test_pipe_convergence import service_hearing


def claimed_by(service, host: Signer, stage: int) -> None:
    """`host`'s claim on `stage`, renewed just now, merged into `service`'s document."""
    deltas: list[bytes] = []
    StageLease(RunDocument("run", host, []), host.peer_id, 4, deltas.append).hold(
        stage, now_ms())
    ours = RunDocument("run", Signer(bytes([9]) * 32), [])
    for d in deltas:
        assert not ours.merge(d, now_ms()).rejected
    service.map.lease = StageLease(ours, service.map.ctx.peer_id, 4, lambda d: None)


def beat(service, peer: str, stage: int, trained: int, seq: int) -> None:
    service.map.ctx.membership.heard(Heartbeat(peer, seq=seq, stats={
        "t": time.time(), "stage": stage, "staged": 1, "step": 40, "trained": trained}))


def run(service, during=None) -> float:
    """How long (trio's clock) `_hear_hosts` took; `during` runs beside it after 3 s."""
    took = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            if during is not None:
                async def later() -> None:
                    await trio.sleep(3)
                    during()
                nursery.start_soon(later)
            t0 = trio.current_time()
            await service.recovery._hear_hosts()
            took.append(trio.current_time() - t0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return took[0]


def test_a_claimed_host_not_heard_yet_is_waited_for_until_its_heartbeat():
    host = Signer(bytes([3]) * 32)
    service = service_hearing(("a0", 0, 0.5, {"step": 40, "trained": 40}), me="z0", stage=1)
    claimed_by(service, host, 3)
    took = run(service, during=lambda: beat(service, host.peer_id, 3, 38, 1))
    assert 3 <= took < 4  # returned once the heartbeat was in, not at the bound


def test_a_host_never_heard_costs_the_bound_and_no_more():
    host = Signer(bytes([4]) * 32)
    service = service_hearing(("a0", 0, 0.5, {"step": 40, "trained": 40}), me="z0", stage=1)
    claimed_by(service, host, 2)
    bound = HEAR_TTLS * service.map.ctx.config.peer_ttl_s
    assert bound <= run(service) < bound + 1


def test_nothing_claimed_and_unheard_means_no_wait():
    service = service_hearing(("a0", 0, 0.5, {"step": 40, "trained": 40}), me="z0", stage=1)
    assert run(service) == 0


def test_a_host_whose_heartbeat_is_late_past_the_ttl_keeps_its_claim_for_the_recovery():
    """Stage 3's host was heard 7 s ago (the live view's ttl is 5 s): the live view has lost
    it, the recovery's read of claims has not (heard within FRESH_S, 15 s), so its stage
    is not judged lost; a host heard 20 s ago is gone from both."""
    service = service_hearing(("a0", 0, 0.5, {"step": 40, "trained": 40}),
                              ("d3", 3, 7.0, {"step": 40, "trained": 38}),
                              ("old", 2, 20.0, {"step": 40, "trained": 30}), me="z0", stage=1)
    assert service.map.trained_of(["a0", "d3", "old"]) == {"a0": 40, "d3": None, "old": None}
    assert service.recovery.claims(["a0", "d3", "old"]) == {"a0": 40, "d3": 38, "old": None}


def test_a_node_whose_own_loop_lags_keeps_the_claims_it_heard_last():
    """Every heartbeat arrived 12-18 s ago (this node's loop was busy): the live view is
    empty; the recovery's read is relative to the newest heartbeat, so both claims stand."""
    service = service_hearing(("a0", 0, 12.0, {"step": 40, "trained": 40}),
                              ("d3", 3, 18.0, {"step": 40, "trained": 38}), me="z0", stage=1)
    assert service.map.trained_of(["a0", "d3"]) == {"a0": None, "d3": None}
    assert service.recovery.claims(["a0", "d3"]) == {"a0": 40, "d3": 38}
    # and the hosts a rebuild may still ask where its live view has none (Recovery._rebuild)
    assert service.map.rows() == [[], ["z0"], [], []]
    assert service.map.rows(heard_within_s=15.0) == [["a0"], ["z0"], [], ["d3"]]
