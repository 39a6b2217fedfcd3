"""The run key's provider sample (node/run/providers.py): ~20 of N members re-provide, the
same ones on every node whose view agrees, and every true sample member provides whatever
its view misses (so the sample never has fewer members than it should)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.run.providers import (
    EPOCH_S,
    PROVIDERS,
    epoch_of,
    provider_sample,
    provider_weight,
    should_provide,
)

RUN = "QmRun"
ids = st.lists(st.text(alphabet="abcdef0123456789", min_size=1, max_size=8), min_size=1,
               max_size=80, unique=True)


@settings(max_examples=60, deadline=None)
@given(peers=ids, k=st.integers(0, 30), epoch=st.integers(0, 10**6))
def test_with_one_view_exactly_min_k_n_provide_and_they_are_the_sample(peers, k, epoch):
    chosen = {p for p in peers if should_provide(RUN, epoch, p, peers, k)}
    assert len(chosen) == min(k, len(peers))
    assert chosen == set(provider_sample(RUN, epoch, peers, k))


@settings(max_examples=60, deadline=None)
@given(peers=ids, k=st.integers(1, 30), data=st.data())
def test_a_partial_view_adds_providers_but_never_loses_a_sample_member(peers, k, data):
    """Views that miss peers (each node's own subset): every member of the full view's
    sample still provides, and at most k + (peers missed, summed over nodes) do."""
    views = {p: data.draw(st.lists(st.sampled_from(peers), unique=True)) for p in peers}
    chosen = {p for p in peers if should_provide(RUN, 7, p, views[p], k)}
    assert set(provider_sample(RUN, 7, peers, k)) <= chosen
    missed = sum(len(set(peers) - set(v) - {p}) for p, v in views.items())
    assert len(chosen) <= min(len(peers), k + missed)


def test_at_10000_peers_20_provide_and_the_sample_rotates_each_epoch():
    peers = [f"12D3KooW{i:08d}" for i in range(10_000)]
    a, b = provider_sample(RUN, 1, peers), provider_sample(RUN, 2, peers)
    assert len(a) == len(b) == PROVIDERS and len(set(a) & set(b)) <= 2
    assert all(should_provide(RUN, 1, p, peers) for p in a)
    assert not should_provide(RUN, 1, sorted(set(peers) - set(a))[0], peers)
    assert epoch_of(7199.9) == 1 and epoch_of(7200.0) == 2


def test_a_joiner_with_an_empty_view_provides_and_weights_are_stable():
    assert should_provide(RUN, 3, "me", [])
    assert provider_weight(RUN, 3, "me") == provider_weight(RUN, 3, "me")
    assert provider_weight(RUN, 3, "me") != provider_weight(RUN, 4, "me")
    with pytest.raises(ValueError):
        should_provide(RUN, 3, "me", [], k=-1)


async def test_a_member_provides_at_the_join_then_only_while_in_the_sample(autojump_clock):
    """ManifestService.provide_sampled: provide at once (a joiner's view is empty), then
    each reprovide_s follow the sample of the live view: out of it, stop re-providing;
    back in it (the view shrank, the epoch turned), provide again."""
    from types import SimpleNamespace

    import trio

    from node.run.manifest import ManifestService, run_key
    from tests.conftest import node_context

    me = "12D3KooWme"
    others = [f"12D3KooW{i:04d}" for i in range(100)]
    view: list[str] = []
    calls: list[str] = []

    class Dht:
        def __init__(self) -> None:
            self.reprovide_interval = 0.0
            self.provided: set[str] = set()

        async def provide(self, key: str) -> None:
            calls.append("provide")
            self.provided.add(key)

        def stop_providing(self, key: str) -> None:
            calls.append("stop")
            self.provided.discard(key)

        def providing(self, key: str) -> bool:
            return key in self.provided

    dht = Dht()
    ctx = node_context(substrate=SimpleNamespace(dht=dht), peer_id=me,
                       membership=SimpleNamespace(live_peers=lambda: list(view)),
                       config={"reprovide_s": 30.0})
    # an epoch in which `me` is outranked by 20 of the others, and one in which it is not
    out = next(e for e in range(1000) if not should_provide(RUN, e, me, others))
    inn = next(e for e in range(1000) if should_provide(RUN, e, me, others))
    epoch = [out]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: ManifestService().provide_sampled(
            ctx, RUN, clock=lambda: epoch[0] * EPOCH_S))
        await trio.sleep(1)
        assert calls == ["provide"] and dht.providing(run_key(RUN))
        view[:] = others
        await trio.sleep(30)
        assert calls == ["provide", "stop"] and not dht.providing(run_key(RUN))
        await trio.sleep(60)
        assert calls == ["provide", "stop"]  # still out: nothing sent
        epoch[0] = inn
        await trio.sleep(30)
        assert calls == ["provide", "stop", "provide"]
        nursery.cancel_scope.cancel()
