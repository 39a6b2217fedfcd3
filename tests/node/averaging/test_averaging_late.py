"""A responder whose own trainer is late for the round refuses the partner's offer: a local
step on both sides, and no mark against the partner in the responder's guard (the fault is
the responder's; under load an honest partner would otherwise collect deadline penalties
round after round until it was banned)."""

from __future__ import annotations

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.averaging import service as averaging
from node.averaging.service import Averager
from p2p.host import Substrate


async def test_a_late_responder_refuses_without_blaming_the_partner():
    subs = [Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    ids = [s.peer_id.to_base58() for s in subs]
    avgs = [Averager(s, "run", me, (lambda other=other: [other]), codecs=["fp32"],
                     step_time=lambda: 0.01, inner_steps=1, lanes=False)
            for s, me, other in zip(subs, ids, reversed(ids), strict=True)]
    initiator = min(range(2), key=lambda i: ids[i])  # the smaller id dials
    responder = 1 - initiator
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for s in subs:
                await nursery.start(s.serve)
            await subs[0].connect(subs[1].addrs()[0])
            # Only the initiator reaches round 1; the responder's trainer never does.
            outcome = await avgs[initiator].exchange(1, torch.ones(1000))
            assert outcome.partner_thetas == []
            gate, slot = subs[responder].gate, avgs[responder]._round(1)
            key = (ids[initiator], averaging.PROTOCOL_ID)
            # Until the responder's handler has run to its end, the guard's part included
            # (the slot's event is set inside the handler, the budget released after it).
            while not (ids[initiator] in slot.inbound_done
                       and slot.inbound_done[ids[initiator]].is_set()
                       and gate.budget.by_protocol[key] == 0):
                await trio.sleep(0.05)
            assert gate.handler_errors == {}
            assert gate.scores.statistics(0.0)["bans"] == {}
            assert gate.misbehaviour == {}
            nursery.cancel_scope.cancel()
