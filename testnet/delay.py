"""A userspace delay line for the testnet's WAN router: netem without netem.

This kernel has no `tc netem` (nor fq, cake). So the router namespace steers every packet
arriving from a WAN link into a TUN device (policy routing: `ip rule iif v<i> lookup 100`,
table 100 = `default dev dly0`). This process reads each packet from the TUN, holds it
`--delay-ms`, and writes it back. The kernel then routes it on by the main table. A
request and its answer each cross the router once, so the round trip grows by twice the
delay; `--rtt 50ms` sets 25 ms here. Measured in ../shared/notes/stack.md §6: RTT p50
50.55 ms for 25 ms a traversal, and TCP at 11.3 MB/s through it plus tbf 100mbit.

    python -m testnet.delay --dev dly0 --delay-ms 25

At most `--queue` packets are held; beyond that packets are dropped, as a full router
queue would drop them. Runs until killed (the namespace teardown kills it).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import heapq
import os
import select
import struct
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def serve(fd: int, delay_s: float, queue: int) -> None:
    held: list[tuple[float, int, bytes]] = []
    seq = 0
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([fd], [], [], timeout)
        if readable:
            while True:
                try:
                    packet = os.read(fd, 65535)
                except BlockingIOError:
                    break
                if len(held) < queue:
                    heapq.heappush(held, (time.monotonic() + delay_s, seq, packet))
                    seq += 1
        now = time.monotonic()
        while held and held[0][0] <= now:
            # a packet the kernel will not take back is dropped, like a loss
            with contextlib.suppress(OSError):
                os.write(fd, heapq.heappop(held)[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", default="dly0")
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--queue", type=int, default=20000)
    args = ap.parse_args()
    serve(open_tun(args.dev), args.delay_ms / 1000.0, args.queue)


if __name__ == "__main__":
    main()
