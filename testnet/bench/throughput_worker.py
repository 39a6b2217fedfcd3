"""One side of the one-stream throughput benchmark, run as its own OS process.

    python -m testnet.bench.throughput_worker recv OUT.json     (prints its address first)
    python -m testnet.bench.throughput_worker send ADDR MB OUT.json
    python -m testnet.bench.throughput_worker tcp-recv OUT.json / tcp-send PORT MB OUT.json

The payload travels in the node's own framing: 4 MiB fp32 tensor frames (protocols/wire.py)
over a libp2p stream (Noise + Yamux); the receiver decodes and verifies every frame.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.stream.exceptions import StreamEOF

from node.transport.streams import READ_SIZE, write_chunks
from p2p.host import Substrate
from protocols.wire import (
    NEED_DATA,
    FrameDecoder,
    TensorFrame,
    encode_tensor_frame,
    make_tensor_header,
    tensor_payload,
)

PROTO = "/peertrain/bench/1.0.0"
CHUNK = 1 << 20  # fp32 values per frame: 4 MiB


def _frames(total_mb: float) -> list[bytes | memoryview]:
    n = int(total_mb * 1e6 / 4)
    data = torch.randn(n)
    out: list[bytes | memoryview] = []
    for i, start in enumerate(range(0, n, CHUNK)):
        dtype, shape, view = tensor_payload(data[start:start + CHUNK])
        out.extend(encode_tensor_frame(make_tensor_header(f"t/{i}", dtype, shape, "raw", view),
                                       view))
    return out


def _save(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f)


async def recv(out: str) -> None:
    done = trio.Event()
    sub = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])

    async def handler(stream) -> None:
        decoder = FrameDecoder(max_tensor_bytes=1 << 24)
        cpu0, t0, nbytes, frames = time.process_time(), None, 0, 0
        while True:
            try:
                data = await stream.read(READ_SIZE)
            except StreamEOF:
                break
            if not data:
                break
            t0 = t0 or time.perf_counter()
            nbytes += len(data)
            decoder.feed(data)
            while (event := decoder.next_event()) is not NEED_DATA:
                frames += isinstance(event, TensorFrame)
        _save(out, {"bytes": nbytes, "frames": frames, "seconds": time.perf_counter() - t0,
                    "cpu_s": time.process_time() - cpu0})
        done.set()

    sub.set_handler(PROTO, handler)
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.serve)
        print(sub.addrs()[0], flush=True)
        with trio.fail_after(300):
            await done.wait()
        nursery.cancel_scope.cancel()


async def send(addr: str, total_mb: float, out: str) -> None:
    chunks = _frames(total_mb)
    sub = Substrate(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    async with trio.open_nursery() as nursery:
        await nursery.start(sub.serve)
        peer = await sub.connect(addr)
        stream = await sub.open_stream(peer, PROTO)
        cpu0, t0 = time.process_time(), time.perf_counter()
        await write_chunks(stream, chunks)
        await stream.close()
        _save(out, {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0})
        nursery.cancel_scope.cancel()


async def tcp_recv(out: str) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    stream = await listeners[0].accept()
    cpu0, t0, nbytes = time.process_time(), None, 0
    while data := await stream.receive_some(READ_SIZE):
        t0 = t0 or time.perf_counter()
        nbytes += len(data)
    _save(out, {"bytes": nbytes, "seconds": time.perf_counter() - t0,
                "cpu_s": time.process_time() - cpu0})


async def tcp_send(port: int, total_mb: float, out: str) -> None:
    payload = memoryview(torch.randn(int(total_mb * 1e6 / 4)).numpy()).cast("B")
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for start in range(0, len(payload), READ_SIZE):
        await stream.send_all(payload[start:start + READ_SIZE])
    await stream.aclose()
    _save(out, {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0})


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "recv":
        trio.run(recv, args[0])
    elif cmd == "send":
        trio.run(send, args[0], float(args[1]), args[2])
    elif cmd == "tcp-recv":
        trio.run(tcp_recv, args[0])
    elif cmd == "tcp-send":
        trio.run(tcp_send, int(args[0]), float(args[1]), args[2])
