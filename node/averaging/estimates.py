"""How long an exchange with each partner should take: what the Averager's deadlines and
the training service's spans are sized from (node/averaging/service.py).

Each partner's throughput is measured (an EWMA over its exchanges), and so are this node's
exchange seconds; before the first measurement they come from a prior wire rate. An
exchange that runs out of its deadline is read for what it says about the link: where the
partner's bytes were still arriving, the link is slower than thought and the rest of the
vector gives the estimate; where nothing arrived or the bytes had stopped (a partner that
never came, or was killed mid-swap), only that partner's next deadline grows. Bookkeeping
only: no I/O, no clock but `time.monotonic()` at a timeout.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

from p2p.timing import Timings

# Before the first exchange is measured, its seconds are estimated at this wire rate (both
# directions together): a 100 Mbit/s home link, full duplex. The training service sizes its
# first spans from it (node/training/service.py), so a prior above the link made every
# first exchange run out of its deadline.
PRIOR_WIRE_BYTES_PER_S = 25e6
# Benchmarks that scale the model and the link alike (`node bench wan --gpu --scale S`) scale
# this prior too, or their first exchanges would be S times too optimistic.
PRIOR_ENV = "PEERTRAIN_PRIOR_WIRE_BYTES_PER_S"
# An exchange cut by its deadline counts as a slow link (ExchangeEstimates.timed_out) only
# while its bytes were still arriving: none for this long (or this share of the deadline)
# is a stall.
STALL_S = 2.0
STALL_SHARE = 0.1


def prior_wire_rate() -> float:
    """PRIOR_WIRE_BYTES_PER_S, or the environment's value if it is a positive number."""
    raw = os.environ.get(PRIOR_ENV, "")
    try:
        value = float(raw) if raw else PRIOR_WIRE_BYTES_PER_S
    except ValueError:
        value = PRIOR_WIRE_BYTES_PER_S
    return value if value > 0 else PRIOR_WIRE_BYTES_PER_S


@dataclass
class PartnerStats:
    bytes_per_s: float = 50e6  # prior until measured: a modest LAN link
    exchanges: int = 0
    failures: int = 0
    # Bytes of tensors by path: "lane" (the bulk TCP lane), "stream" (libp2p) or "webrtc".
    sent: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)
    last_exchange_unix: float | None = None  # wall clock, for the status page
    last_seconds: float | None = None
    # Bytes on the wire per second during the swap alone (both directions, after the
    # codec; not the wait at the boundary): what `outer.codec = "auto"` decides by.
    wire_bytes_per_s: float | None = None
    last_codec: str | None = None
    kept_off_relay: int = 0  # rounds skipped: the payload was over network.relay_exchange_mb


@dataclass
class Progress:
    """One swap under way: when it began, its size each way, what has arrived and when."""

    started: float
    total: int  # our payload's bytes: the partner's is the same codec and size
    received: int = 0
    last: float = 0.0  # time.monotonic() of the last byte received


class ExchangeEstimates:
    def __init__(self, prior_rate: float | None = None) -> None:
        self.partners: dict[str, PartnerStats] = {}
        self.seconds = Timings()  # successful exchanges, start to vector received
        self.prior_rate = prior_wire_rate() if prior_rate is None else prior_rate
        self._expected: float | None = None  # the EWMA of those seconds
        self._bound = False  # _expected is only a bound from timeouts so far

    def of(self, partner: str) -> PartnerStats:
        return self.partners.setdefault(partner, PartnerStats())

    def expected_s(self, payload_bytes: int) -> float:
        """Seconds one exchange takes: the EWMA of those measured, or before the first, a
        payload of `payload_bytes` each way at the prior wire rate."""
        if self._expected is not None:
            return self._expected
        return 2 * payload_bytes / self.prior_rate

    def deadline(self, partner: str, numel: int, *, expected_s: float, skew_s: float,
                 rtt_s: float, handshake_rtts: int) -> float:
        """Expected transfer of `numel` fp32 values each way at the partner's rate (4x
        margin), the handshake's round trips, plus the skew a partner may have at the
        boundary. A partner never measured gets at least `expected_s`, what this node's
        exchanges take: each new partner's first exchange timed out on a link slower than
        the LAN prior, a local round each (`node bench wan --gpu`)."""
        st = self.partners.get(partner)
        transfer = 2 * numel * 4 / max((st or PartnerStats()).bytes_per_s, 1e5)
        if st is None or not st.exchanges:
            transfer = max(transfer, expected_s)
        return max(2.0, 4 * transfer + handshake_rtts * rtt_s + skew_s)

    def timed_out(self, partner: str, limit: float, numel: int,
                  progress: Progress | None = None) -> None:
        """An exchange ran out of its deadline. Where the partner's vector was arriving, it
        takes at least `limit` plus what the rest would have taken at the rate seen.
        Without this, a prior rate above the link's kept every deadline (and the span sized
        from the expected seconds) too short for any exchange to finish and be measured: at
        6 Mbit/s, 32 rounds local in a row (`node bench wan --gpu`). So the expected seconds
        become that estimate, and the partner's rate estimate at most half what it was (the
        next deadline at least doubles)."""
        st = self.of(partner)
        now = time.monotonic()
        if (progress is None or progress.received == 0
                or now - progress.last > max(STALL_S, STALL_SHARE * limit)):
            # Nothing arrived (the partner never came: views of the round or the span that
            # differ, a late trainer), or the bytes had stopped (a partner killed or stalled
            # mid-swap): neither says anything of the link. A longer deadline next time, the
            # expected seconds left alone: taken as slowness, one killed partner grew a LAN
            # testnet's span, and a restarted node's jump with it (tests/swarm/test_churn.py).
            st.bytes_per_s /= 2
            return
        seconds = now - progress.started
        left = max(0, progress.total - progress.received)
        # at most twice the deadline: early bytes are slow (TCP's slow start, other swaps
        # still on the link)
        expected = min(2 * limit, limit + left * seconds / progress.received)
        st.bytes_per_s = min(st.bytes_per_s / 2, 2 * numel * 4 / expected)
        self._expected = max(self._expected or 0.0, expected)
        self._bound = True

    def record(self, partner: str, nbytes: int, seconds: float, ok: bool) -> None:
        """An exchange that finished (`ok`: its bytes and seconds measure the link) or
        failed."""
        st = self.of(partner)
        if ok and seconds > 0:
            st.bytes_per_s = 0.7 * st.bytes_per_s + 0.3 * (nbytes / seconds) if st.exchanges \
                else nbytes / seconds
            st.exchanges += 1
            st.last_exchange_unix, st.last_seconds = time.time(), round(seconds, 3)
            self.seconds.observe(seconds)
            # the first measurement replaces a bound left by exchanges that ran out of time
            self._expected = seconds if self._expected is None or self._bound \
                else 0.7 * self._expected + 0.3 * seconds
            self._bound = False
        elif not ok:
            st.failures += 1
