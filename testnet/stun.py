"""A tiny RFC 5780 STUN responder for the nat scenario's WAN (run inside a namespace).

miniupnpd refuses to map ports when its WAN address is a reserved one (the testnet's
198.18.0.0/15), unless STUN says the gateway is not behind a restrictive NAT
(`ext_perform_stun`). Its check sends Binding Requests with every CHANGE-REQUEST
combination and wants an answer to each from the asked-for address, so the responder
listens on two IPs x two ports and answers from the socket the request asks for.

    python -m testnet.stun --ip 198.18.0.1 --alt-ip 198.18.0.2 [--port 3478]

Answers MAPPED-ADDRESS and XOR-MAPPED-ADDRESS; ignores anything that is not a
well-formed Binding Request. Runs until killed (the launcher's namespace teardown).
"""

from __future__ import annotations

import argparse
import select
import socket
import struct

MAGIC = 0x2112A442
BINDING_REQUEST, BINDING_SUCCESS = 0x0001, 0x0101
MAPPED_ADDRESS, XOR_MAPPED_ADDRESS, CHANGE_REQUEST = 0x0001, 0x0020, 0x0003
CHANGE_IP, CHANGE_PORT = 0x04, 0x02


def parse_request(data: bytes) -> tuple[bytes, int] | None:
    """(transaction id, change flags) of a Binding Request; None for anything else."""
    if len(data) < 20:
        return None
    kind, length, cookie = struct.unpack_from("!HHI", data)
    if kind != BINDING_REQUEST or cookie != MAGIC or length != len(data) - 20:
        return None
    flags, pos = 0, 20
    while pos + 4 <= len(data):
        attr, size = struct.unpack_from("!HH", data, pos)
        if attr == CHANGE_REQUEST and size == 4 and pos + 8 <= len(data):
            flags = struct.unpack_from("!I", data, pos + 4)[0]
        pos += 4 + size + (-size % 4)
    return data[8:20], flags


def response(txid: bytes, ip: str, port: int) -> bytes:
    """A Binding Success with the source address, plain and XOR-ed."""
    raw_ip = socket.inet_aton(ip)
    mapped = struct.pack("!HHBBH", MAPPED_ADDRESS, 8, 0, 1, port) + raw_ip
    xip = bytes(a ^ b for a, b in zip(raw_ip, struct.pack("!I", MAGIC), strict=True))
    xored = struct.pack("!HHBBH", XOR_MAPPED_ADDRESS, 8, 0, 1, port ^ (MAGIC >> 16)) + xip
    body = mapped + xored
    return struct.pack("!HHI", BINDING_SUCCESS, len(body), MAGIC) + txid + body


def serve(ip: str, alt_ip: str, port: int, alt_port: int) -> None:
    socks: dict[tuple[str, int], socket.socket] = {}
    for a in (ip, alt_ip):
        for p in (port, alt_port):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((a, p))
            socks[(a, p)] = s
    while True:
        ready, _, _ = select.select(list(socks.values()), [], [])
        for s in ready:
            data, (src_ip, src_port) = s.recvfrom(2048)
            req = parse_request(data)
            if req is None:
                continue
            txid, flags = req
            here_ip, here_port = s.getsockname()
            out_ip = (alt_ip if here_ip == ip else ip) if flags & CHANGE_IP else here_ip
            out_port = ((alt_port if here_port == port else port) if flags & CHANGE_PORT
                        else here_port)
            socks[(out_ip, out_port)].sendto(response(txid, src_ip, src_port),
                                             (src_ip, src_port))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ip", required=True)
    ap.add_argument("--alt-ip", required=True)
    ap.add_argument("--port", type=int, default=3478)
    args = ap.parse_args()
    serve(args.ip, args.alt_ip, args.port, args.port + 1)


if __name__ == "__main__":
    main()
