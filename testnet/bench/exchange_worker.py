"""One side of the pairwise-exchange benchmark (testnet/bench/exchange.py), its own process.

    python -m testnet.bench.exchange_worker A OUT.json MB CODEC            (prints addr, id)
    python -m testnet.bench.exchange_worker B OUT.json MB CODEC ADDR ID

Both sides run the node's real averaging adapter (node/averaging/service.py) over a real libp2p
connection and exchange a vector of MB megabytes of fp32 for round 1. OUT.json gets the
wall time of the exchange and the CPU time this process spent in it (all its threads).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from node.averaging.service import Averager
from node.process.memory import tune_malloc
from node.training.rounds import TrainingStats
from p2p.host import Substrate


async def main(role: str, out: str, mb: float, codec: str, addr: str = "",
               other: str = "") -> None:
    tune_malloc()  # as a node does at start (node/process/memory.py)
    sub = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    me = sub.peer_id.to_base58()
    partner: list[str] = [other] if other else []
    connected = trio.Event()
    stats = TrainingStats()
    averager = Averager(sub, "bench", me, lambda: partner, codecs=[codec], stats=stats,
                        step_time=lambda: 1.0, inner_steps=2)
    seed, partner_seed = (1, 2) if role == "A" else (2, 1)
    vec = torch.randn(int(mb * 1e6 / 4), generator=torch.Generator().manual_seed(seed))
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.serve)
        if role == "A":
            print(sub.addrs()[0], me, flush=True)
            while not sub.connected_peers():  # B dials us; bounded by the parent's timeout
                await trio.sleep(0.01)
            partner.append(sub.connected_peers()[0].to_base58())
        else:
            await sub.connect(addr)
        connected.set()
        t0, c0 = time.perf_counter(), time.process_time()
        outcome = await averager.exchange(1, vec)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        theirs = torch.randn(vec.numel(), generator=torch.Generator().manual_seed(partner_seed))
        err = (float((outcome.partner_thetas[0] - theirs).norm() / theirs.norm())
               if outcome.partner_thetas else None)
        with open(out, "w") as f:
            json.dump({"seconds": seconds, "cpu": cpu, "ok": bool(outcome.partner_thetas),
                       "rel_err": err, "sent": stats.bytes_sent,
                       "received": stats.bytes_received}, f)
        await trio.sleep(0.5)  # let the partner finish reading before we disappear
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    role, out, mb, codec, *rest = sys.argv[1:]
    trio.run(main, role, out, float(mb), codec, *rest)
