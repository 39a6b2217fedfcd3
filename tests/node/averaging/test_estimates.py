"""What an exchange should take (node/averaging/estimates.py): measured rates and seconds,
deadlines, and what a timed-out exchange says about the link. Pure bookkeeping: no host."""

from __future__ import annotations

import pytest

from node.averaging import estimates
from node.averaging.estimates import ExchangeEstimates, PartnerStats, Progress
from testnet.bench import wan_gpu

N = 1_000_000  # values per exchange: 8 MB each way in fp32
SKEW = 2.5  # the boundary skew the Averager passes (half a round of its trainer)


def _deadline(est: ExchangeEstimates, partner: str, expected_s: float) -> float:
    return est.deadline(partner, N, expected_s=expected_s, skew_s=SKEW, rtt_s=0.0,
                        handshake_rtts=6)


def test_the_expected_seconds_start_at_the_prior_then_follow_the_measurements():
    est = ExchangeEstimates(prior_rate=25e6)
    assert est.expected_s(2 * N) == pytest.approx(2 * 2 * N / 25e6)  # bf16 both ways
    est.record("peer", 8 * N, 10.0, ok=True)
    est.record("peer", 8 * N, 20.0, ok=True)
    assert est.expected_s(2 * N) == pytest.approx(0.7 * 10.0 + 0.3 * 20.0)
    assert est.partners["peer"].exchanges == 2 and est.seconds.snapshot()["count"] == 2


def test_an_exchange_nobody_answered_lengthens_the_deadline_not_the_estimate():
    est = ExchangeEstimates(prior_rate=25e6)
    first = _deadline(est, "z", est.expected_s(2 * N))
    est.timed_out("z", first, N)  # nothing arrived: a longer deadline, the estimate kept
    assert _deadline(est, "z", est.expected_s(2 * N)) - SKEW == pytest.approx(2 * (first - SKEW))
    assert est.expected_s(2 * N) == pytest.approx(2 * 2 * N / 25e6)


def test_a_swap_cut_by_its_deadline_estimates_the_rest_from_what_arrived(monkeypatch):
    """A quarter of the partner's vector arrived in the 3 s of swap before a 10 s deadline:
    the rest would take 9 s more, so an exchange is expected to take 19 s."""
    est = ExchangeEstimates(prior_rate=25e6)
    monkeypatch.setattr(estimates.time, "monotonic", lambda: 104.0)
    est.timed_out("z", 10.0, N, Progress(101.0, 2 * N, received=N // 2, last=103.9))
    assert est.expected_s(2 * N) == pytest.approx(19.0)
    assert est.partners["z"].bytes_per_s == pytest.approx(8 * N / 19.0)
    # never more than twice the deadline from early bytes; a measurement replaces it
    est.timed_out("y", 5.0, N, Progress(103.9, 2 * N, received=1000, last=103.95))
    assert est.expected_s(2 * N) == pytest.approx(19.0)  # 10 < 19: kept
    est.timed_out("y", 10.0, N, Progress(103.9, 2 * N, received=1000, last=104.0))
    assert est.expected_s(2 * N) == pytest.approx(20.0)
    est.record("y", 8 * N, 12.0, ok=True)
    assert est.expected_s(2 * N) == 12.0


def test_a_swap_whose_bytes_had_stopped_is_a_stall_not_a_slow_link(monkeypatch):
    """Half the vector came in the first second, then nothing for 9 s (a partner killed
    mid-swap): the deadline for that partner doubles, the expected seconds stay."""
    est = ExchangeEstimates(prior_rate=25e6)
    monkeypatch.setattr(estimates.time, "monotonic", lambda: 110.0)
    prior = est.expected_s(2 * N)
    est.timed_out("z", 10.0, N, Progress(100.0, 2 * N, received=N, last=101.0))
    assert est.expected_s(2 * N) == prior
    assert est.partners["z"].bytes_per_s == pytest.approx(PartnerStats().bytes_per_s / 2)


def test_a_new_partners_deadline_allows_what_our_exchanges_took():
    est = ExchangeEstimates(prior_rate=25e6)
    est.record("old", 8 * N, 15.0, ok=True)  # our exchanges take 15 s
    expected = est.expected_s(2 * N)
    assert _deadline(est, "new", expected) == pytest.approx(4 * 15.0 + SKEW)
    assert _deadline(est, "old", expected) == pytest.approx(4 * 15.0 + SKEW)  # measured


def test_a_failed_exchange_counts_and_measures_nothing():
    est = ExchangeEstimates(prior_rate=25e6)
    est.record("z", 0, 0, ok=False)
    assert (est.of("z").failures, est.of("z").exchanges) == (1, 0)
    assert est.expected_s(2 * N) == pytest.approx(2 * 2 * N / 25e6)


def test_the_scaled_benchmark_names_the_prior_and_the_environment_overrides_it(monkeypatch):
    assert (wan_gpu.PRIOR_ENV, wan_gpu.PRIOR_WIRE_BYTES_PER_S) == \
        (estimates.PRIOR_ENV, estimates.PRIOR_WIRE_BYTES_PER_S)
    monkeypatch.setenv(estimates.PRIOR_ENV, "1.5e6")
    assert estimates.prior_wire_rate() == ExchangeEstimates().prior_rate == 1.5e6
    for bad in ("fast", "-1", "0"):
        monkeypatch.setenv(estimates.PRIOR_ENV, bad)
        assert estimates.prior_wire_rate() == estimates.PRIOR_WIRE_BYTES_PER_S
