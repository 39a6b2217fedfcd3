"""`outer.codec = "auto"`: the initiator offers the codec the path to its partner calls
for (node/averaging/adapt.py), and a real exchange between two hosts uses it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import trio

from node.averaging import adapt
from protocols import manifest as mf
from tests.conftest import averager_pair, exchange_both

NUMEL = 100_000
BF16_SWAP = 2 * 2 * NUMEL  # bytes both ways in bf16


def test_a_named_codec_is_offered_on_every_path():
    for path in ("direct", "relayed via QmX"):
        assert adapt.offer("fp32", NUMEL, path=path, wire_rate=1.0, round_s=1.0) == ["fp32"]
        assert adapt.offer("bf16", NUMEL, path=path, wire_rate=1.0, round_s=1.0) == \
            ["bf16", "fp32"]


@pytest.mark.parametrize(("path", "rate", "round_s", "first"), [
    ("direct", None, 1.0, "bf16"),                      # nothing measured yet
    ("direct", BF16_SWAP / 0.2, 1.0, "bf16"),           # a swap takes 0.2 s of a 1 s round
    ("direct", BF16_SWAP / 0.3, 1.0, "int8"),           # 0.3 s: more than a quarter
    ("punched", BF16_SWAP / 0.3, 10.0, "bf16"),         # the same link, longer rounds
    ("relayed via QmRelay", BF16_SWAP * 100, 10.0, "int8"),  # relays carry int8 however fast
])
def test_auto_offers_int8_first_where_the_path_calls_for_it(path, rate, round_s, first):
    offered = adapt.offer("auto", NUMEL, path=path, wire_rate=rate, round_s=round_s)
    assert offered[0] == first and sorted(offered) == ["bf16", "fp32", "int8"]


def test_the_manifest_takes_auto_and_a_node_of_such_a_run_accepts_every_codec():
    assert mf.parse_manifest('[run]\nname = "a"\n[outer]\ncodec = "auto"\n').outer.codec == "auto"
    assert adapt.supported("auto") == ["bf16", "int8", "fp32"]
    assert adapt.supported("int8") == ["int8", "fp32"]


async def test_an_auto_exchange_shrinks_to_int8_once_the_link_is_measured_slow():
    subs, ids, avgs, initiator = averager_pair(codecs=adapt.supported("auto"),
                                               auto_codec=True, lanes=False)
    partner = ids[1 - avgs.index(initiator)]
    vectors = [torch.linspace(-1, 1, NUMEL) * (i + 1) for i in range(2)]
    async with trio.open_nursery() as nursery:
        for s in subs:
            await nursery.start(s.serve)
        await subs[0].connect(subs[1].addrs()[0])

        first = await exchange_both(avgs, 1, vectors)
        assert all(o.partner_thetas for o in first)
        st = initiator.partners[partner]
        assert st.last_codec == "bf16" and st.wire_bytes_per_s and st.wire_bytes_per_s > 0
        assert initiator.statistics()["partners"][partner]["codec"] == "bf16"

        # As if the link had measured 1 kB/s: a bf16 swap would outlast the round.
        st.wire_bytes_per_s = 1e3
        sent_before = sum(st.sent.values())
        second = await exchange_both(avgs, 2, vectors)
        assert all(o.partner_thetas for o in second)
        assert st.last_codec == "int8"
        assert sum(st.sent.values()) - sent_before < 1.1 * NUMEL  # ~1 byte a value
        got = second[avgs.index(initiator)].partner_thetas[0]
        theirs = vectors[1 - avgs.index(initiator)]
        assert (got - theirs).abs().max() < 2 * theirs.abs().max() / 127  # int8's step
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("codec", "limit", "averaged"), [
    ("auto", 2 * NUMEL, True),    # int8 through a relay: NUMEL bytes + scales fit in 2x
    ("auto", NUMEL // 2, False),  # even int8 is over the limit
    ("bf16", NUMEL, False),       # a named codec is what goes: 2 bytes a value
    ("bf16", 3 * NUMEL, True),
])
async def test_a_relayed_partner_is_averaged_with_only_under_the_runs_relay_limit(
        codec, limit, averaged):
    # network.relay_exchange_mb: both sides see the relayed path and decide alike, so a
    # payload over the limit costs a local step at once (no deadline waited out), counted.
    kwargs = {"codecs": adapt.supported(codec), "auto_codec": codec == adapt.AUTO,
              "relay_limit": limit}
    subs, ids, avgs, _ = averager_pair(**kwargs)
    relayed = SimpleNamespace(paths=lambda: dict.fromkeys(ids, "relayed via QmRelay"),
                              rtt_ms={})
    for avg in avgs:
        avg.transports.attach(kinds=relayed)
    vectors = [torch.full((NUMEL,), float(i)) for i in range(2)]
    async with trio.open_nursery() as nursery:
        for s in subs:
            await nursery.start(s.serve)
        await subs[0].connect(subs[1].addrs()[0])
        with trio.fail_after(10):  # well under the round's deadline when kept off
            outcomes = await exchange_both(avgs, 1, vectors)
        for i, (avg, o) in enumerate(zip(avgs, outcomes, strict=True)):
            partner = avg.statistics()["partners"][ids[1 - i]]
            if averaged:
                assert len(o.partner_thetas) == 1 and partner["kept_off_relay"] == 0
            else:
                assert o.partner_thetas == [] and partner["kept_off_relay"] == 1
                assert partner["failures"] == 0 and partner["bytes_sent"] == {}
        nursery.cancel_scope.cancel()


def test_the_relay_limit_is_a_manifest_field_that_keeps_old_run_ids():
    base = mf.parse_manifest('[run]\nname = "r"\n')
    assert base.network.relay_exchange_mb == mf.RELAY_EXCHANGE_MB
    assert "relay_exchange_mb" not in mf.canonical_bytes(base).decode()  # same bytes as before
    small = mf.parse_manifest('[run]\nname = "r"\n[network]\nrelay_exchange_mb = 8\n')
    assert small.network.relay_exchange_mb == 8.0
    assert mf.parse_canonical(mf.canonical_bytes(small)) == small
    assert mf.run_id(mf.canonical_bytes(small)) != mf.run_id(mf.canonical_bytes(base))
    with pytest.raises(mf.ManifestError, match=r"network\.relay_exchange_mb"):
        mf.parse_manifest('[run]\nname = "r"\n[network]\nrelay_exchange_mb = -1\n')
