"""Duplicate relayed connections behind real NATs (issue 26, item 6): one process of the
scenario, run inside its namespace by tests/swarm/test_relay_duplicate_nat.py.

    python -m testnet.relaydup relay DIR LISTEN
    python -m testnet.relaydup peer  DIR LISTEN NAME OTHER ROUNDS

The relay (public) writes its address to DIR/relay.addr. A peer (behind a symmetric NAT)
dials it, reserves a slot (want=1), writes its relayed address to DIR/NAME.addr, waits for
OTHER's and for DIR/go (a start time on the wall clock both read), then dials OTHER's
relayed address ROUNDS times, so both peers dial each other at the same moment, each dial
a new relayed connection beside the ones open: a burst of BURST dials 0.5 s apart, then
the rest 0.5 s apart once py-libp2p's grace period (20 s) is over, when each new connection
makes its swarm trim the peer's connections past its per-peer limit (3). Each dial that
got through starts a stream echoing 16 KiB chunks, so the relay is writing when the
trimmed connections' circuits end (without it the old code failed about 1 run in 10,
with it 2 in 6: docs/nat.md). After each round,
and SETTLE_S after the last, it records its relay link: the same connection object as at
the start, still open, the reservation still held. The result is DIR/NAME.json; DIR/stop ends every
process. Every wait is bounded (DEADLINE_S)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.reach.relays import RelayService
from p2p.host import DialError, Substrate

DEADLINE_S = 120.0
# To hunt a rare failure, RELAYDUP_GRACE=S sets py-libp2p's grace period in the peers to
# S - 1 seconds and starts the later dials S seconds in, and RELAYDUP_ROUND their spacing
# (docs/nat.md: 1 s grace, 60 rounds 0.3 s apart). Without them, py-libp2p's own 20 s.
ROUND_S = float(os.environ.get("RELAYDUP_ROUND", "0.5"))
BURST = 3  # under the relay's circuits_per_peer (4): each of these dials gets a circuit
# past py-libp2p's GRACE_PERIOD (20 s): older connections can be trimmed
GRACE_S = float(os.environ.get("RELAYDUP_GRACE", "21.0"))
SETTLE_S = 2.0


def at(start: float, i: int) -> float:
    """When round `i` dials (wall clock: both peers share it)."""
    return start + i * ROUND_S if i < BURST else start + GRACE_S + (i - BURST) * ROUND_S


async def _file(path: Path, deadline: float) -> str:
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} within {DEADLINE_S:g} s")
        await trio.sleep(0.05)
    return path.read_text().strip()


ECHO = "/peertrain-test/relaydup-echo/1"
CHUNK = b"x" * 16384


async def _echo(stream) -> None:
    try:
        while data := await stream.read(65536):
            await stream.write(data)
    except Exception:  # the connection was trimmed, the circuit ended
        return


async def _pump(sub: Substrate, peer: ID) -> None:
    """Keep data flowing to `peer` and back on one stream until it breaks, so the relay
    is writing when circuits end (as between training peers)."""
    try:
        stream = await sub.open_stream(peer, ECHO)
        while True:
            await stream.write(CHUNK)
            await stream.read(65536)
    except Exception:
        return


def _link(sub: Substrate, relay: ID) -> list:
    return list(sub.require_host().get_network().get_connections(relay))


async def relay(d: Path, listen: str) -> None:
    sub = Substrate(create_new_key_pair(), [listen])
    svc = RelayService(lambda: "public", want=1, tick_s=0.2)
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.serve)
        await nursery.start(svc.run, SimpleNamespace(substrate=sub))
        (d / "relay.addr").write_text(sub.addrs()[0])
        deadline = time.monotonic() + 2 * DEADLINE_S
        while not (d / "stop").exists() and time.monotonic() < deadline:
            await trio.sleep(0.1)
        stats = svc.statistics()["serving"]
        stats["connections"] = {p.to_base58(): len(cs) for p, cs in
                                sub.require_host().get_network().get_connections_map().items()}
        stats["gate"] = {k: v for k, v in sub.gate.statistics().items()
                         if k in ("refused", "misbehaviour", "bans")}
        (d / "relay.json").write_text(json.dumps(stats, indent=1, default=str))
        nursery.cancel_scope.cancel()


async def peer(d: Path, listen: str, name: str, other: str, rounds: int) -> None:
    sub = Substrate(create_new_key_pair(), [listen])
    # direct=True as a node runs it: it tries the other peer directly (its addresses are
    # LAN ones behind a symmetric NAT: skipped as private)
    svc = RelayService(lambda: "private", want=1, tick_s=0.2, retry_s=600)
    out: dict = {"name": name, "peer_id": sub.peer_id.to_base58(), "rounds": []}
    deadline = time.monotonic() + DEADLINE_S
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.serve)
        if "RELAYDUP_GRACE" in os.environ:
            sub.require_host().get_network().connection_config.grace_period = GRACE_S - 1
        await nursery.start(svc.run, SimpleNamespace(substrate=sub))
        sub.set_handler(ECHO, _echo)
        relay_id = ID.from_base58((r_addr := await _file(d / "relay.addr", deadline))
                                  .rsplit("/p2p/", 1)[1])
        await sub.connect(r_addr, timeout=20)
        while relay_id.to_base58() not in svc.held:
            if time.monotonic() > deadline:
                raise TimeoutError("no reservation")
            await trio.sleep(0.05)
        (first,) = _link(sub, relay_id)
        mine = next(a for a in sub.addrs() if "/p2p-circuit" in a)
        (d / f"{name}.addr").write_text(mine)
        theirs = await _file(d / f"{other}.addr", deadline)
        start = float(await _file(d / "go", deadline))
        other_id = ID.from_base58(theirs.rsplit("/p2p/", 1)[1])

        def check(i: int, err: str | None, t0: float) -> dict:
            links = _link(sub, relay_id)
            return {
                "i": i, "dial_ms": round((time.monotonic() - t0) * 1000), "error": err,
                "link_same": links == [first], "link_open": not first.is_closed,
                "links": len(links), "held": relay_id.to_base58() in svc.held,
                "to_other": len(sub.require_host().get_network().get_connections(other_id)),
            }

        for i in range(rounds):
            await trio.sleep(max(0.0, at(start, i) - time.time()))
            t0 = time.monotonic()
            err = None
            try:
                with trio.fail_after(10):
                    await sub.connect(theirs, timeout=10)
            except (DialError, trio.TooSlowError) as e:
                err = str(e)
            out["rounds"].append(check(i, err, t0))
            if err is None:
                nursery.start_soon(_pump, sub, other_id)
        await trio.sleep(SETTLE_S)  # the issue saw the link close within 0.5 s
        out["settled"] = check(rounds, None, time.monotonic())
        out["relay_error"] = svc.last_error
        out["restarts"] = sub.stats.restarts
        out["gate"] = {k: v for k, v in sub.gate.statistics().items()
                       if k in ("refused", "misbehaviour", "bans")}
        out["slots"] = sub.slots.statistics()
        (d / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))
        stop_by = time.monotonic() + DEADLINE_S
        while not (d / "stop").exists() and time.monotonic() < stop_by:
            await trio.sleep(0.1)
        nursery.cancel_scope.cancel()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("node.relay").setLevel(logging.INFO)
    role, d, listen = argv[0], Path(argv[1]), argv[2]
    if role == "relay":
        trio.run(relay, d, listen)
    else:
        trio.run(peer, d, listen, argv[3], argv[4], int(argv[5]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
