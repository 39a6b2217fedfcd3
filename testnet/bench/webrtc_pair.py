"""One peer of the WebRTC measurement: a public relay + STUN peer, or a NATed peer that
reaches the other NATed peer through the relay, gets a WebRTC path, then exchanges a
tensor over an averaging round and pushes a bulk payload through a data channel.

Run inside the namespaces of `tests/swarm/test_webrtc_nat.py` (or by hand, one per namespace):

    python -m testnet.bench.webrtc_pair --role public  --listen /ip4/IP/tcp/4001 --dir D
    python -m testnet.bench.webrtc_pair --role private --listen /ip4/IP/tcp/4001 --dir D \
        --name a --other b [--mb 32]

The peers meet through files in D (the namespaces share the file system): `public.addr`,
`<name>.relayed`. Each private peer writes `<name>.json`: its path to the other, the ICE
pair, whether the averaging exchange returned the other's tensor, and (on the side that
offers) the bulk rate in MB/s. Exits nonzero with the reason if any step fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.files import atomic_write
from node.reach.relays import RelayService
from node.transport.transports import Transports
from node.webrtc import PATH_WEBRTC
from node.webrtc.service import WebRtcService
from p2p.host import Substrate

SINK = "/peertrain-bench/sink/1"
NUMEL = 1 << 20  # a 4 MB fp32 tensor for the averaging round


def _publish(path: Path, out: dict) -> None:
    """Write a result whole (node.files.atomic_write): the test and the other peer poll
    for it and read it the moment it exists (a half-written one failed a CI run's JSON
    decode)."""
    atomic_write(path, json.dumps(out).encode())


async def _file(path: Path, timeout: float) -> str:
    with trio.fail_after(timeout):
        while not path.exists() or not path.read_text().strip():
            await trio.sleep(0.1)
    return path.read_text().strip()


async def _sink(stream) -> None:
    """Read an 8-byte length, then that many bytes; answer how many arrived."""
    got, want = b"", None
    total = 0
    while True:
        data = await stream.read()
        if not data:
            return
        if want is None:
            got += data
            if len(got) < 8:
                continue
            want = struct.unpack(">Q", got[:8])[0]
            total = len(got) - 8
        else:
            total += len(data)
        if total >= want:
            await stream.write(struct.pack(">Q", total))
            return


async def _push(open_stream, peer: ID, mb: int, path: str) -> float:
    """Bytes per second of `mb` MB pushed through a stream, until the sink's ack."""
    stream = await open_stream(peer, SINK)
    assert getattr(stream, "path", "relay") == path, f"not the {path} path"
    size = mb * 1_000_000
    block = memoryview(bytes(1 << 20))
    started = time.monotonic()
    await stream.write(struct.pack(">Q", size))
    sent = 0
    while sent < size:
        n = min(len(block), size - sent)
        await stream.write(block[:n])
        sent += n
    ack = await stream.read()
    seconds = time.monotonic() - started
    assert struct.unpack(">Q", ack)[0] == size, ack
    await stream.close()
    return size / seconds


async def public(args: argparse.Namespace) -> None:
    sub = Substrate(create_new_key_pair(), [args.listen])
    relay = RelayService(lambda: "public", want=1, tick_s=0.5, retry_s=600, direct=False)
    rtc = WebRtcService(lambda: "public")
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.serve)
        await nursery.start(relay.run, SimpleNamespace(substrate=sub))
        await nursery.start(rtc.run, SimpleNamespace(substrate=sub))
        await sub.ready.wait()
        (Path(args.dir) / "public.addr").write_text(f"{sub.addrs()[0]}")
        await trio.sleep_forever()  # until the test kills it


async def private(args: argparse.Namespace) -> None:
    import torch

    from node.averaging.service import Averager

    d = Path(args.dir)
    out = {"name": args.name}
    sub = Substrate(create_new_key_pair(), [args.listen])
    relay = RelayService(lambda: "private", want=1, tick_s=0.5, retry_s=600, direct=False)
    rtc = WebRtcService(lambda: "private", connect_timeout_s=args.ice_timeout)
    rtc.set_handler(SINK, _sink)
    sub.set_handler(SINK, _sink)
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.serve)
        await nursery.start(relay.run, SimpleNamespace(substrate=sub))
        await nursery.start(rtc.run, SimpleNamespace(substrate=sub))
        await sub.connect(await _file(d / "public.addr", 60), timeout=20)
        with trio.fail_after(60):
            while not any("/p2p-circuit" in a for a in sub.addrs()):
                await trio.sleep(0.2)
        mine = next(a for a in sub.addrs() if "/p2p-circuit" in a)
        (d / f"{args.name}.relayed").write_text(mine)
        theirs = await _file(d / f"{args.other}.relayed", 60)
        other = ID.from_base58(theirs.rsplit("/p2p/", 1)[1])
        if args.name < args.other:  # one side dials through the relay
            await sub.connect(theirs, timeout=30)
        key = other.to_base58()
        # averaging's handler is in place before any session (as in a node)
        door = Transports(sub)
        door.attach(channels=rtc)  # the averager serves on the data channels too
        avg = Averager(sub, "run", sub.peer_id.to_base58(), lambda: [key], codecs=["fp32"],
                       step_time=lambda: 30.0, inner_steps=1, transports=door)
        started = time.monotonic()
        with trio.move_on_after(args.ice_timeout + 30):
            while not (key in rtc.paths() or rtc.failed):
                await trio.sleep(0.2)
        out["libp2p_path"] = sub.peer_paths().get(key)
        out["path"] = rtc.paths().get(key) or out["libp2p_path"]
        out["webrtc"] = rtc.statistics()
        if key not in rtc.paths():
            out["error"] = rtc.last_error or "no webrtc path"
            _publish(d / f"{args.name}.json", out)
            # Stay until the other has looked at its path too: leaving closes our
            # connections (p2p/host.py), and the other would then find none.
            await _file(d / f"{args.other}.json", 120)
            nursery.cancel_scope.cancel()
            return
        out["found_s"] = round(time.monotonic() - started, 2)  # includes the 5 s pass tick
        out["setup_s"] = rtc.statistics()["sessions"][key]["setup_s"]
        vec = torch.full((NUMEL,), 1.0 if args.name < args.other else 2.0)
        outcome = await avg.exchange(1, vec)
        want = 2.0 if args.name < args.other else 1.0
        out["exchange_ok"] = bool(outcome.partner_thetas) and bool(
            torch.all(outcome.partner_thetas[0] == want))
        out["exchange_s"] = avg.partners[key].last_seconds if key in avg.partners else None
        out["exchange_bytes"] = dict(avg.partners[key].received) if key in avg.partners else {}
        if sub.peer_id.to_base58() < key and args.mb:
            out["mb_per_s"] = round(await _push(rtc.open_stream, other, args.mb,
                                                PATH_WEBRTC) / 1e6, 2)
            # the same payload through the relay, for comparison at the same load
            out["relay_mb_per_s"] = round(await _push(sub.open_stream, other, args.mb,
                                                      "relay") / 1e6, 2)
            out["mb"] = args.mb
        out["webrtc"] = rtc.statistics()
        _publish(d / f"{args.name}.json", out)
        await _file(d / f"{args.other}.json", 120)  # keep answering until the other is done
        nursery.cancel_scope.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["public", "private"], required=True)
    ap.add_argument("--listen", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", default="a")
    ap.add_argument("--other", default="b")
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--ice-timeout", type=float, default=20.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    for noisy in ("libp2p", "aioice", "aiortc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    trio.run(public if args.role == "public" else private, args)


if __name__ == "__main__":
    main()
