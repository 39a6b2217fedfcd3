"""A tiny RFC 5780 STUN responder for the nat scenario's WAN (run inside a namespace).

miniupnpd refuses to map ports when its WAN address is a reserved one (the testnet's
198.18.0.0/15), unless STUN says the gateway is not behind a restrictive NAT
(`ext_perform_stun`). Its check sends Binding Requests with every CHANGE-REQUEST
combination and wants an answer to each from the asked-for address, so the responder
listens on two IPs x two ports and answers from the socket the request asks for.

    python -m testnet.stun --ip 198.18.0.1 --alt-ip 198.18.0.2 [--port 3478]

Answers MAPPED-ADDRESS and XOR-MAPPED-ADDRESS; ignores anything that is not a
well-formed Binding Request. The messages are protocols/stun.py's, the codec of the nodes'
own responders (node/webrtc/stun.py): this file is only the sockets. Runs until killed (the
launcher's namespace teardown).
"""

from __future__ import annotations

import argparse
import select
import socket

from protocols import stun
from protocols.errors import RemoteProtocolError


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
            try:
                req = stun.parse_request(data)  # the codec the nodes' own responders use
            except RemoteProtocolError:
                continue
            here_ip, here_port = s.getsockname()
            out_ip = ((alt_ip if here_ip == ip else ip)
                      if req.change & stun.CHANGE_IP else here_ip)
            out_port = ((alt_port if here_port == port else port)
                        if req.change & stun.CHANGE_PORT else here_port)
            socks[(out_ip, out_port)].sendto(stun.encode_success(req.txid, src_ip, src_port),
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
