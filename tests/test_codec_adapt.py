"""`outer.codec = "auto"`: the initiator offers the codec the path to its partner calls
for (node/averaging/adapt.py), and a real exchange between two hosts uses it."""

from __future__ import annotations

import pytest
import torch
import trio

from node.averaging import adapt
from protocols import manifest as mf

from .conftest import averager_pair, exchange_both

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
