"""How a joiner finds its run's manifest (node/run/manifest.py `resolve`): every connected
peer is asked at once, without waiting for the DHT lookup, and the first verified answer
wins; every peer's reason is listed when none has it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from node.errors import ManifestRejected, RunNotFound
from node.run import manifest as service
from protocols import manifest as mf
from testnet import launcher
from tests.conftest import node_context

MANIFEST = mf.load_manifest_file(launcher.default_manifest_path())
RUN_ID = mf.run_id(mf.canonical_bytes(MANIFEST))


class Peer(str):
    def to_base58(self) -> str:
        return str(self)


def _ctx(connected: list[str], providers: list[str] | None) -> SimpleNamespace:
    """A node connected to `connected`; its DHT lookup names `providers` after 5 s (None:
    never returns)."""
    async def find_providers(key: str) -> list[SimpleNamespace]:
        assert key == f"run/{RUN_ID}"
        if providers is None:
            await trio.sleep_forever()
        await trio.sleep(5)
        return [SimpleNamespace(peer_id=Peer(p)) for p in providers]

    penalized: list[tuple[str, str]] = []
    substrate = SimpleNamespace(
        peer_id=Peer("QmMe"), connected_peers=lambda: [Peer(p) for p in connected],
        dht=SimpleNamespace(find_providers=find_providers),
        gate=SimpleNamespace(penalize=lambda peer, why: penalized.append((peer, why))))
    return node_context(runs=SimpleNamespace(get=lambda run_id: None), substrate=substrate,
                        config={"join_timeout_s": 30.0}, penalized=penalized)


@pytest.fixture
def answers(monkeypatch) -> dict[str, tuple[float, object]]:
    """peer -> (seconds it takes to answer, the manifest or the exception it answers)."""
    table: dict[str, tuple[float, object]] = {}

    async def fetch(substrate, peer, run_id: str) -> mf.Manifest:
        delay, answer = table[str(peer)]
        await trio.sleep(delay)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(service, "fetch_manifest", fetch)
    return table


async def test_a_connected_peer_answers_without_waiting_for_the_dht(autojump_clock, answers):
    answers.update({"QmBoot": (0.3, MANIFEST), "QmSlow": (4.0, MANIFEST)})
    resolver = service.ManifestService()
    manifest = await resolver.resolve(_ctx(["QmSlow", "QmBoot"], providers=None), RUN_ID)
    assert manifest == MANIFEST
    assert (resolver.source, trio.current_time()) == ("QmBoot", 0.3)  # the slow ask: cancelled


async def test_the_dht_providers_are_asked_when_no_connected_peer_has_it(autojump_clock,
                                                                        answers):
    answers.update({"QmBoot": (0.1, LookupError("this peer does not hold run")),
                    "QmMember": (0.2, MANIFEST)})
    resolver = service.ManifestService()
    await resolver.resolve(_ctx(["QmBoot"], providers=["QmBoot", "QmMember"]), RUN_ID)
    assert (resolver.source, trio.current_time()) == ("QmMember", 5.2)


async def test_every_peer_s_reason_is_listed_when_none_has_it(autojump_clock, answers):
    forged = mf.ManifestError("its bytes hash to QmOther, not to the run-id")
    answers.update({"QmBoot": (0.1, LookupError("this peer does not hold run")),
                    "QmForger": (0.1, forged)})
    ctx = _ctx(["QmBoot"], providers=["QmForger"])
    with pytest.raises(ManifestRejected) as err:
        await service.ManifestService().resolve(ctx, RUN_ID)
    assert trio.current_time() == pytest.approx(30.0, abs=0.5)  # the join timeout
    text = str(err.value)
    assert "QmBoot: this peer does not hold run" in text
    assert "QmForger: served a bad manifest: its bytes hash to QmOther" in text
    assert ctx.penalized and set(ctx.penalized) == {("QmForger", "invalid")}


async def test_no_peer_at_all_is_run_not_found(autojump_clock, answers):
    with pytest.raises(RunNotFound, match="no peer in the DHT provides it"):
        await service.ManifestService().resolve(_ctx([], providers=[]), RUN_ID)
