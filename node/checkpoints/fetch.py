"""`node ckpt pull`: a short-lived libp2p host that fetches one checkpoint, then goes away.

Why not the daemon: an operator seeds a new machine with a run's checkpoint, or copies one
off a run, without joining the run (no training, no gossip, no identity kept). The host has
a fresh key; only the checkpoint is written to the state directory.

Providers are the peers given with `--from` (dialed directly) and, with `--bootstrap`, the
providers of `ckpt/<cid>` the DHT knows. The pull itself is the daemon's
(node/checkpoints/exchange.py: every provider in parallel, every chunk verified,
resumable); after it
every chunk on disk is verified once more, and one bad chunk left by an earlier pull is
fetched again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from node.checkpoints import exchange as ckpt_sync
from node.checkpoints.store import CheckpointError, CheckpointStore
from node.errors import BootstrapUnreachable, NodeError
from node.membership.records import VALIDATORS
from p2p.host import DialError, Substrate, parse_peer_addr
from protocols import checkpoint as ck
from protocols import multihash

log = logging.getLogger("node.ckpt")

LISTEN = "/ip4/127.0.0.1/tcp/0"  # we only dial out; nobody needs to reach us


class BadArgument(NodeError):
    exit_code = 2


@dataclass
class FetchReport:
    cid: str
    manifest: ck.CheckpointManifest
    already_held: bool
    result: ckpt_sync.PullResult | None  # None when the checkpoint was already here
    unreachable: dict[str, str]  # peer address -> why it could not be dialed
    dht_providers: list[str] = field(default_factory=list)  # provider records found (--bootstrap)

    @property
    def mb_s(self) -> float:
        r = self.result
        return r.fetched_bytes / 1e6 / r.seconds if r and r.seconds > 0 else 0.0


def validate_cid(cid: str) -> str:
    """A checkpoint id is the base58 of a sha2-256 multihash ("Qm...", 46 characters)."""
    if not multihash.is_sha256_id(cid):
        raise BadArgument(
            f"not a checkpoint id: {cid!r} (expected 46 base58 characters "
            "starting with Qm, as `node ckpt ls` prints them)"
        )
    return cid


async def fetch(
    cid: str,
    store: CheckpointStore,
    *,
    peers: list[str],
    bootstrap: list[str],
    run: str | None = None,
    dial_timeout: float = 10.0,
    chunk_timeout: float = 30.0,
    progress: Callable[
        [int, int, ck.CheckpointManifest | None], None
    ] = lambda done, total, manifest: None,
) -> FetchReport:
    """Pull `cid` into `store` from `peers` and the DHT providers found via `bootstrap`."""
    validate_cid(cid)
    for addr in [*peers, *bootstrap]:
        try:
            parse_peer_addr(addr)
        except DialError as e:
            raise BadArgument(str(e)) from None
    if not peers and not bootstrap:
        raise BadArgument(
            "say where to pull from: --from <peer multiaddr> (repeatable) "
            "and/or --bootstrap <multiaddr> to find providers in the DHT"
        )
    check = _check_run(run)
    if store.latest_ok(cid) and not store.verify(cid):
        m = store.manifest(cid)
        check(m)
        return FetchReport(cid, m, True, None, {})

    substrate = Substrate(create_new_key_pair(), [LISTEN], dht_protocol_validators=VALIDATORS)
    async with trio.open_nursery() as nursery:
        await nursery.start(substrate.serve)
        try:
            return await _fetch(
                substrate,
                cid,
                store,
                peers,
                bootstrap,
                check,
                dial_timeout,
                chunk_timeout,
                progress,
            )
        finally:
            nursery.cancel_scope.cancel()


async def _fetch(
    substrate: Substrate,
    cid: str,
    store: CheckpointStore,
    peers: list[str],
    bootstrap: list[str],
    check: Callable[[ck.CheckpointManifest], None],
    dial_timeout: float,
    chunk_timeout: float,
    progress: Callable[[int, int, ck.CheckpointManifest | None], None],
) -> FetchReport:
    unreachable: dict[str, str] = {}
    reached: dict[str, ID] = {}

    async def dial(addr: str) -> None:
        try:
            reached[addr] = await substrate.connect(addr, timeout=dial_timeout)
        except DialError as e:
            unreachable[addr] = e.reason

    async with trio.open_nursery() as nursery:
        for addr in [*peers, *bootstrap]:
            nursery.start_soon(dial, addr)
    if not reached:
        raise BootstrapUnreachable(
            "could not reach any peer:\n  "
            + "\n  ".join(f"{a}: {r}" for a, r in unreachable.items())
            + "\nCheck the addresses (and that the peers are up)."
        )
    providers = [reached[a] for a in peers if a in reached]
    announced = 0
    dht_providers: list[str] = []
    if bootstrap:
        assert substrate.dht is not None
        await substrate.dht.bootstrap()
        found = await substrate.dht.find_providers(f"ckpt/{cid}")
        peerstore = substrate.host.get_peerstore() if substrate.host else None
        dht_providers = [info.peer_id.to_base58() for info in found]
        for info in found:
            if info.peer_id == substrate.peer_id or info.peer_id in providers:
                continue
            if peerstore is not None and info.addrs:
                peerstore.add_addrs(info.peer_id, info.addrs, 600)
            providers.append(info.peer_id)
            announced += 1
        log.info("DHT: %d providers of %s", announced, cid)
        # the peers we entered through may hold it without having announced it
        providers += [reached[a] for a in bootstrap if a in reached and reached[a] not in providers]
    hint = (
        f"\nThe DHT reached through {', '.join(bootstrap)} knows no provider of it. Check "
        "the id (`node ckpt ls` on a node that has it), or name a holder with --from."
        if bootstrap and not announced and not peers
        else ""
    )

    manifest_seen: list[ck.CheckpointManifest] = []

    def checked(m: ck.CheckpointManifest) -> None:
        check(m)
        manifest_seen.append(m)

    def on_progress(done: int, total: int) -> None:
        progress(done, total, manifest_seen[0] if manifest_seen else None)

    try:
        result = await ckpt_sync.pull(
            substrate,
            providers,
            cid,
            store,
            chunk_timeout=chunk_timeout,
            progress=on_progress,
            check=checked,
        )
    except CheckpointError as e:
        raise CheckpointError(f"{e}{hint}") from e
    problems = await trio.to_thread.run_sync(store.verify, cid)
    if problems:  # a damaged chunk from an earlier, interrupted pull: fetch it once more
        for digest in {d for d in result.manifest.chunks}:
            path = store.chunks / digest
            if path.exists() and ck.sha256_hex(path.read_bytes()) != digest:
                path.unlink()
        again = await ckpt_sync.pull(
            substrate, providers, cid, store, chunk_timeout=chunk_timeout, progress=on_progress
        )
        for peer, n in again.bytes_by_peer.items():
            result.bytes_by_peer[peer] = result.bytes_by_peer.get(peer, 0) + n
        for peer, n in again.chunks_by_peer.items():
            result.chunks_by_peer[peer] = result.chunks_by_peer.get(peer, 0) + n
        result.seconds += again.seconds
        problems = await trio.to_thread.run_sync(store.verify, cid)
        if problems:
            raise CheckpointError(
                f"checkpoint {cid} fails verification after the pull:\n  " + "\n  ".join(problems)
            )
    return FetchReport(cid, result.manifest, False, result, unreachable, dht_providers)


def _check_run(run: str | None) -> Callable[[ck.CheckpointManifest], None]:
    def check(m: ck.CheckpointManifest) -> None:
        if run is not None and m.run != run:
            raise CheckpointError(
                f"checkpoint is of run {m.run}, not of --run {run}; nothing was fetched"
            )

    return check
