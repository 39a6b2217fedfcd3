"""Reference run for `node bench exchange`: hivemind's DecentralizedAverager, two peers.

Runs inside a separate venv with hivemind==1.1.12 (not a peertrain dependency):
    python hivemind_averager.py MB OUT.json
Two averagers (hivemind starts each in its own process, plus its p2pd daemons) average one
fp32 tensor of MB megabytes in a group of two; the wall time of one step is reported.
"""

import json
import sys
import time

import hivemind
import torch


def main(mb: float, out: str) -> None:
    n = int(mb * 1e6 / 4)
    dht1 = hivemind.DHT(start=True)
    dht2 = hivemind.DHT(initial_peers=dht1.get_visible_maddrs(), start=True)
    kwargs = dict(prefix="bench", target_group_size=2, min_group_size=2, start=True,
                  min_matchmaking_time=1.0, request_timeout=30.0)
    avg1 = hivemind.averaging.DecentralizedAverager([torch.randn(n)], dht1, **kwargs)
    avg2 = hivemind.averaging.DecentralizedAverager([torch.randn(n)], dht2, **kwargs)
    try:
        # Warm-up round: matchmaking and connection set-up, as a node would have done before.
        c1, c2 = avg1.step(wait=False), avg2.step(wait=False)
        c1.result(timeout=300), c2.result(timeout=300)
        t0 = time.perf_counter()
        c1, c2 = avg1.step(wait=False), avg2.step(wait=False)
        c1.result(timeout=300), c2.result(timeout=300)
        seconds = time.perf_counter() - t0
    finally:
        for x in (avg1, avg2, dht1, dht2):
            x.shutdown()
    with open(out, "w") as f:
        json.dump({"seconds": seconds}, f)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
