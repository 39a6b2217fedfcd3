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
    a, b = torch.randn(n), torch.randn(n)
    avg1 = hivemind.averaging.DecentralizedAverager([a.clone()], dht1, **kwargs)
    avg2 = hivemind.averaging.DecentralizedAverager([b.clone()], dht2, **kwargs)
    try:
        # Warm-up round: matchmaking and connection set-up, as a node would have done before.
        c1, c2 = avg1.step(wait=False), avg2.step(wait=False)
        warm = (c1.result(timeout=300), c2.result(timeout=300))
        with avg1.get_tensors() as tensors:  # averaged in place: both now hold the mean
            ok = bool(torch.allclose(tensors[0], (a + b) / 2, atol=1e-5))
        t0 = time.perf_counter()
        c1, c2 = avg1.step(wait=False), avg2.step(wait=False)
        timed = (c1.result(timeout=300), c2.result(timeout=300))
        seconds = time.perf_counter() - t0
    finally:
        for x in (avg1, avg2, dht1, dht2):
            x.shutdown()
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "averaged": ok,
                   "groups": [warm[0] is not None, timed[0] is not None]}, f)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
