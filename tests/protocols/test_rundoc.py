"""The run document: CRDT laws, convergence under lossy gossip, rejection, GC, persistence."""

import contextlib
import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.keys import Signer
from protocols.rundoc import (
    HLC,
    MAX_COUNTER,
    Entry,
    RunDocument,
    Stamp,
    authorize,
    checkpoint_index,
    sign_entry,
    signed_payload,
)

RUN = "run-1"
SIGNERS = [Signer(bytes([i + 1]) * 32) for i in range(5)]
ADMIN = SIGNERS[0]
ADMINS = {ADMIN.peer_id}
PIDS = [s.peer_id for s in SIGNERS]
T0 = 1_700_000_000_000
NOW = T0 + 1_000_000
KINDS = ["own", "ckpt", "own-ckpt", "run", "stage"]


def new_doc(i: int = 0, **limits) -> RunDocument:
    return RunDocument(RUN, SIGNERS[i], ADMINS, **limits)


EMPTY_SUMMARY = new_doc().summary()


def full(doc: RunDocument) -> bytes:
    return doc.delta_since(EMPTY_SUMMARY)


def write(doc: RunDocument, kind: str, v: int, delete: bool, now: int) -> bytes:
    """A legal write for `doc`'s signer: its namespace, a shared ckpt, or an admin key."""
    pid = doc.signer.peer_id
    admin = pid in ADMINS
    if kind == "run" and admin:
        key = "run/settings/lr"
    elif kind == "stage":
        key = "stage/1" if admin else f"stage/1/{pid}"
    elif kind == "ckpt":
        key, delete = "ckpt/c1", delete and admin
    elif kind == "own-ckpt":  # announced in the writer's namespace, deleted by it
        key = f"peer/{pid}/ckpt/c{v % 2}"
    else:
        key = f"peer/{pid}/k{v % 2}"
    if delete:
        return doc.delete(key, now)
    if "ckpt" in key:
        return doc.set(key, {"hash": key.rsplit("/", 1)[1], "v": v}, now)
    return doc.set(key, v, now)


def oracle(deltas: list[bytes]) -> dict[str, bytes]:
    """Per key, the signature of the last writer's entry among everything ever written."""
    best: dict[str, Entry] = {}
    for d in deltas:
        for e in new_doc().decode_delta(d):
            if e.key not in best or e.order > best[e.key].order:
                best[e.key] = e
    return {k: e.signature for k, e in best.items()}


def state(doc: RunDocument) -> dict[str, bytes]:
    return {e.key: e.signature for e in doc.entries()}


def join(*docs: RunDocument) -> RunDocument:
    out = new_doc(4)
    for d in docs:
        assert out.merge(full(d), NOW).rejected == []
    return out


def sync(a: RunDocument, b: RunDocument, now_a: int, now_b: int) -> None:
    """One anti-entropy exchange: summaries cross, then each answers the other's."""
    sa, sb = a.summary(), b.summary()
    da, db = a.delta_since(sb), b.delta_since(sa)
    assert a.merge(db, now_a).rejected == []
    assert b.merge(da, now_b).rejected == []
    assert a.digest() == b.digest()


ops = st.lists(
    st.tuples(
        st.integers(0, 4),  # writer
        st.sampled_from(KINDS),
        st.integers(0, 3),  # value
        st.booleans(),  # delete
        st.integers(0, 20),  # ms after T0: small, so stamps collide across writers
    ),
    min_size=3,
    max_size=25,
)


def make_deltas(op_list) -> list[bytes]:
    writers = [new_doc(i) for i in range(5)]
    return [write(writers[w], k, v, d, T0 + dt) for w, k, v, d, dt in op_list]


# -- CRDT laws --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(ops, st.data())
def test_merge_commutes_associates_and_is_idempotent(op_list, data):
    deltas = make_deltas(op_list)
    parts = [new_doc(i) for i in range(3)]
    for d in deltas:
        parts[data.draw(st.integers(0, 2))].merge(d, NOW)
    a, b, c = parts
    assert join(a, b).digest() == join(b, a).digest()
    assert join(join(a, b), c).digest() == join(a, join(b, c)).digest()
    assert join(a, a).digest() == a.digest()
    assert a.merge(full(a), NOW).applied == []
    assert state(join(a, b, c)) == oracle(deltas)


@settings(max_examples=60, deadline=None)
@given(ops, st.data())
def test_any_order_with_duplicates_gives_the_same_state(op_list, data):
    deltas = make_deltas(op_list)
    shuffled = (
        data.draw(st.permutations(deltas + data.draw(st.lists(st.sampled_from(deltas)))))
        if deltas
        else []
    )
    in_order, any_order = new_doc(1), new_doc(2)
    for d in deltas:
        in_order.merge(d, NOW)
    for d in shuffled:
        assert any_order.merge(d, NOW).rejected == []
    assert in_order.digest() == any_order.digest()
    assert state(in_order) == oracle(deltas)


step = st.tuples(
    st.sampled_from(["write", "write", "deliver", "deliver", "deliver", "tick", "cut", "sync"]),
    st.integers(0, 2**20),
    st.integers(0, 2**20),
    st.integers(0, 3),
    st.booleans(),
)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(3, 5),
    st.lists(st.integers(-5_000, 5_000), min_size=5, max_size=5),
    st.lists(step, min_size=10, max_size=80),
)
def test_replicas_converge_after_lossy_gossip_and_partitions(n, skews, steps):
    reps = [new_doc(i) for i in range(n)]
    pool: list[tuple[int, bytes]] = []  # every delta ever gossiped; delivery picks any, any time
    group = [0] * n
    t = T0

    def now(i):
        return t + skews[i]  # each replica's clock is off by up to 5 s

    for kind, a, b, v, flag in steps:
        r = a % n
        if kind == "write":
            pool.append((r, write(reps[r], KINDS[v], b % 5, flag, now(r))))
        elif kind == "deliver" and pool:
            origin, delta = pool[b % len(pool)]
            if group[origin] == group[r]:  # across a partition: lost
                assert reps[r].merge(delta, now(r)).rejected == []
        elif kind == "tick":
            t += b % 3_000
        elif kind == "cut":  # a new partition (or heal, when flag is False)
            group = [(b >> i) & 1 if flag else 0 for i in range(n)]
        elif kind == "sync" and group[r] == group[b % n] and r != b % n:
            sync(reps[r], reps[b % n], now(r), now(b % n))
    for _ in range(2):  # heal: a star of pairwise exchanges, twice
        for i in range(1, n):
            sync(reps[0], reps[i], now(0), now(i))
    assert len({r.digest() for r in reps}) == 1
    assert state(reps[0]) == oracle([d for _, d in pool])


def test_anti_entropy_is_capped_and_makes_progress():
    a, b = new_doc(1, max_delta_bytes=8_000), new_doc(2)
    for i in range(60):
        a.set(f"peer/{PIDS[1]}/blob{i}", b"x" * 900, T0 + i)
    rounds = 0
    while a.digest() != b.digest():
        delta = a.delta_since(b.summary())
        assert len(delta) <= 8_000
        assert b.merge(delta, NOW).applied
        rounds += 1
    assert 6 <= rounds <= 12


# -- HLC --------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.integers(0, 2_000),
            st.integers(-10_000, 10_000),
            st.integers(-10_000, 50_000),
            st.integers(0, 5),
        ),
        max_size=50,
    )
)
def test_hlc_is_monotonic_under_skew(events):
    clock, t, prev, highest = HLC("me"), T0, (0, 0), 0
    for receive, dt, skew, remote_skew, counter in events:
        t += dt
        now = t + skew  # the local clock jumps back and forth by up to 10 s
        if receive:
            remote = Stamp(now + remote_skew, counter, "them")
            s = clock.observe(remote, now)
            assert (s.wall_ms, s.counter) > (remote.wall_ms, remote.counter)
            highest = max(highest, remote.wall_ms)
        else:
            s = clock.tick(now)
        assert (s.wall_ms, s.counter) > prev
        assert s.wall_ms <= max(highest, now, prev[0])  # stays at the highest clock seen
        prev = (s.wall_ms, s.counter)


def test_hlc_refuses_far_future():
    clock = HLC("me")
    clock.tick(T0)
    clock.observe(Stamp(T0 + 60_000, 0, "x"), T0)  # exactly max drift: fine
    before = clock.last
    with pytest.raises(RemoteProtocolError, match="ahead"):
        clock.observe(Stamp(T0 + 60_001 + 5, 0, "x"), T0 + 5)
    assert clock.last == before


def test_hlc_counter_overflow_borrows_a_millisecond():
    clock = HLC("me")
    s = clock.observe(Stamp(T0, MAX_COUNTER, "x"), T0)
    assert (s.wall_ms, s.counter) == (T0 + 1, 0)


# -- rejection --------------------------------------------------------------------------------


@pytest.fixture
def doc():
    d = new_doc(3)
    d.set(f"peer/{PIDS[3]}/addrs", ["/ip4/10.0.0.3/tcp/4001"], T0)
    admin = new_doc(0)
    d.merge(admin.set("run/settings/lr", 3e-4, T0), NOW)
    d.merge(new_doc(1).set("ckpt/bafy1", {"hash": "bafy1", "step": 10}, T0), NOW)
    return d


def entry(i, key, value, wall=T0 + 5, tombstone=False, run=RUN) -> Entry:
    return sign_entry(run, SIGNERS[i], key, value, Stamp(wall, 0, ""), tombstone)


def refused(doc, e_or_delta, words):
    before = doc.digest()
    delta = e_or_delta if isinstance(e_or_delta, bytes) else doc.encode_delta([e_or_delta])
    result = doc.merge(delta, NOW)
    assert result.applied == []
    assert len(result.rejected) == 1 and words in result.rejected[0][1], result.rejected
    assert doc.digest() == before


P1, P2 = PIDS[1], PIDS[2]


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (lambda: dataclasses.replace(entry(1, f"peer/{P1}/x", 1), packed=b"\x02"), "signature"),
        (
            lambda: dataclasses.replace(entry(1, f"peer/{P2}/x", 1), hlc=Stamp(T0 + 5, 0, P2)),
            "signature",
        ),
        (lambda: entry(1, f"peer/{P2}/x", 1), "only"),
        (lambda: entry(1, "run/settings/lr", 1.0), "admins"),
        (lambda: entry(1, "stage/1", [P1]), "admins"),
        (lambda: entry(1, f"stage/1/{P2}", True), "only"),
        (lambda: entry(1, "ckpt/bafy2", {"hash": "bafy9"}), "hash"),
        (lambda: entry(1, "ckpt/bafy2", "bafy2"), "hash"),
        (lambda: entry(1, "ckpt/bafy1", None, tombstone=True), "admins"),
        (lambda: entry(1, f"peer/{P1}/ckpt/bafy2", {"hash": "bafy9"}), "hash"),
        (lambda: entry(1, f"peer/{P2}/ckpt/bafy2", {"hash": "bafy2"}), "only"),
        (lambda: entry(1, f"peer/{P2}/ckpt/bafy2", None, tombstone=True), "only"),
        (lambda: entry(1, "elsewhere/x", 1), "namespace"),
        (lambda: entry(1, f"peer//{P1}", 1), "malformed key"),
        (lambda: entry(1, f"peer/{P1}/a b", 1), "malformed key"),
        (lambda: entry(1, f"peer/{P1}/big", b"x" * 20_000), "B >"),
        (
            lambda: dataclasses.replace(
                entry(1, f"peer/{P1}/t", None, tombstone=True), packed=b"\x01"
            ),
            "tombstone",
        ),
        (lambda: entry(1, f"peer/{P1}/x", 1, wall=NOW + 61_000), "future"),
        (lambda: entry(1, f"peer/{P1}/x", 1, run="run-2"), "signature"),  # cross-run replay
        (  # a writer field that is no Ed25519 peer id, on a key anyone may write
            lambda: dataclasses.replace(entry(1, "ckpt/c", {"hash": "c"}), hlc=Stamp(T0, 0, "1")),
            "peer id",
        ),
    ],
)
def test_bad_entries_are_rejected_and_change_nothing(doc, bad, words):
    refused(doc, bad(), words)


def test_garbled_value_is_rejected(doc):
    key, hlc = f"peer/{P1}/x", Stamp(T0, 0, P1)
    sig = SIGNERS[1].sign(signed_payload(RUN, key, b"\xc1", hlc, False))
    refused(doc, Entry(key, b"\xc1", hlc, False, sig), "undecodable value")


def test_a_valid_entry_in_a_bad_batch_still_applies(doc):
    good, bad = entry(1, f"peer/{P1}/x", 1), entry(1, "run/settings/lr", 1.0)
    result = doc.merge(doc.encode_delta([bad, good]), NOW)
    assert result.applied == [good.key] and [k for k, _ in result.rejected] == [bad.key]


def test_full_document_refuses_new_keys():
    d = new_doc(3, max_entries=1)
    d.set(f"peer/{PIDS[3]}/a", 1, T0)
    refused(d, entry(1, f"peer/{P1}/x", 1), "full")
    with pytest.raises(LocalProtocolError, match="full"):
        d.set(f"peer/{PIDS[3]}/b", 1, T0)


def test_envelope_errors_raise(doc):
    before = doc.digest()
    other_run = RunDocument("run-2", SIGNERS[1], ADMINS).set(f"peer/{P1}/x", 1, T0)
    for bad in (other_run, b"", b"\x93\x02", msgpack.packb([1, RUN, [[1, 2]]]), b"x" * (5 << 20)):
        with pytest.raises(RemoteProtocolError):
            doc.merge(bad, NOW)
    for bad in (b"", msgpack.packb([1, RUN, b"1234567"]), msgpack.packb([1, RUN, 5])):
        with pytest.raises(RemoteProtocolError):
            doc.delta_since(bad)
    assert doc.digest() == before


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_bytes_raise_or_are_rejected(garbage):
    d = new_doc(3)
    before = d.digest()
    with contextlib.suppress(RemoteProtocolError):
        assert d.merge(garbage, NOW).applied == []
    assert d.digest() == before


VALID = new_doc(1).set(f"peer/{P1}/addrs", ["/ip4/1.2.3.4/tcp/1"], T0)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(VALID) - 1), st.integers(1, 255))
def test_mutated_deltas_never_apply_anything_else(pos, xor):
    mutated = bytearray(VALID)
    mutated[pos] ^= xor
    d = new_doc(3)
    with contextlib.suppress(RemoteProtocolError):
        d.merge(bytes(mutated), NOW)
    reference = new_doc(3)
    reference.merge(VALID, NOW)
    assert d.digest() in (new_doc(3).digest(), reference.digest())


def test_local_misuse_raises_local_errors():
    d = new_doc(1)
    for key, value in [
        (f"peer/{P2}/x", 1),
        ("run/settings/lr", 1.0),
        ("ckpt/a", {"hash": "b"}),
        (f"peer/{P1}/x", {1: 2}),  # int map keys do not survive strict decoding
        (f"peer/{P1}/x", object()),
        (f"peer/{P1}/x", b"x" * 20_000),
    ]:
        with pytest.raises(LocalProtocolError):
            d.set(key, value, T0)
    assert len(d) == 0
    with pytest.raises(LocalProtocolError):
        RunDocument(RUN, SIGNERS[1], {"not-a-peer-id"})


def test_authorize_is_pure_and_readable():
    assert authorize(entry(0, "run/settings/lr", 1.0), ADMINS) is None
    assert authorize(entry(0, "run/settings/lr", 1.0), set()) is not None
    assert authorize(entry(2, f"stage/3/{P2}", True), ADMINS) is None
    assert authorize(entry(2, "ckpt/q", {"hash": "q", "step": 1}), ADMINS) is None
    assert authorize(entry(2, f"peer/{P2}/ckpt/q", {"hash": "q"}), ADMINS) is None
    assert authorize(entry(2, f"peer/{P2}/ckpt/q", None, tombstone=True), ADMINS) is None


def test_checkpoint_index_lists_shared_and_own_entries_newest_last_without_deleted_ones():
    doc = new_doc(1)
    doc.set("ckpt/qa", {"hash": "qa", "step": 30}, T0)
    doc.set(f"peer/{P1}/ckpt/qb", {"hash": "qb", "step": 50}, T0)
    doc.set(f"peer/{P1}/ckpt/qc", {"hash": "qc", "step": 10}, T0)
    doc.set(f"peer/{P1}/ckpt/qd", {"hash": "qd", "step": "garbage"}, T0)
    doc.set(f"peer/{P1}/addrs", ["/ip4/127.0.0.1/tcp/1"], T0)  # not a checkpoint
    assert checkpoint_index(doc) == [(0, "qd", P1), (10, "qc", P1), (30, "qa", P1),
                                     (50, "qb", P1)]
    replica = new_doc(2)
    replica.merge(full(doc), NOW)
    replica.merge(doc.delete(f"peer/{P1}/ckpt/qb", T0 + 1), NOW)  # retention dropped it
    assert checkpoint_index(replica)[-1] == (30, "qa", P1)


# -- reads, GC, membership, persistence -------------------------------------------------------


def test_reads_and_tombstones():
    d = new_doc(1)
    d.set(f"peer/{P1}/a", 1, T0)
    d.set(f"peer/{P1}/b", (1, 2), T0)
    d.delete(f"peer/{P1}/a", T0)
    assert d.get(f"peer/{P1}/a") is None and d.entry(f"peer/{P1}/a").tombstone
    assert list(d.items(f"peer/{P1}/")) == [(f"peer/{P1}/b", [1, 2])]  # as every replica sees it
    assert d.statistics().tombstones == 1


def test_gc_bounds_the_document_under_churn():
    observer, horizon, biggest = new_doc(0), 50_000, 0
    for i in range(1000):
        peer = RunDocument(RUN, Signer(i.to_bytes(32, "big")), ADMINS)
        pid, now = peer.signer.peer_id, T0 + i * 1_000
        observer.merge(peer.set(f"peer/{pid}/addrs", ["/ip4/10.0.0.1/tcp/1"], now), now)
        observer.merge(peer.set(f"peer/{pid}/last_seen", now, now), now)
        if i % 3:  # two in three leave politely; the rest crash and leave live entries
            observer.merge(peer.delete(f"peer/{pid}/addrs", now + 500), now + 500)
            observer.merge(peer.delete(f"peer/{pid}/last_seen", now + 500), now + 500)
        if i % 10 == 0:
            observer.gc(now, horizon)
        biggest = max(biggest, len(observer))
    # ~60 peers' two keys are younger than the horizon at any time; without GC: 2,000
    assert biggest <= 2 * 62
    assert observer.statistics().floor_ms == T0 + 990_000 - horizon


def test_gc_horizon_prevents_resurrection_and_fresh_replicas_bootstrap():
    a, b, stale = new_doc(1), new_doc(2), new_doc(3)
    key = f"peer/{P1}/x"
    first = a.set(key, "old", T0)
    b.merge(first, T0)
    stale.merge(first, T0)
    b.merge(a.delete(key, T0 + 1_000), T0 + 1_000)  # stale misses the delete
    b.merge(a.set(f"peer/{P1}/last_seen", 1, T0 + 100_000), T0 + 100_000)
    assert b.gc(T0 + 100_000, horizon_ms=10_000) == 1 and b.entry(key) is None
    result = b.merge(stale.delta_since(b.summary()), T0 + 100_000)
    assert (key, "older than the GC horizon for an unknown key") in result.rejected
    assert b.get(key) is None and b.entry(key) is None
    fresh = new_doc(4)  # a new replica has no horizon yet: it takes everything from b
    fresh.merge(b.delta_since(fresh.summary()), T0 + 100_000)
    assert fresh.digest() == b.digest()


def test_gc_forgets_silent_peers():
    d = new_doc(0)
    d.merge(new_doc(1).set(f"peer/{P1}/addrs", [], T0), T0)
    d.merge(new_doc(2).set(f"peer/{P2}/addrs", [], T0 + 50_000), T0 + 50_000)
    d.set("run/settings/lr", 0.1, T0)  # not a peer key: kept however old
    assert d.gc(T0 + 60_000, horizon_ms=30_000) == 1
    assert [e.key for e in d.entries()] == [f"peer/{P2}/addrs", "run/settings/lr"]


def test_members_by_last_seen():
    d = new_doc(0)
    for i, age in [(1, 1_000), (2, 30_000), (3, 5_000)]:
        d.merge(new_doc(i).set(f"peer/{PIDS[i]}/last_seen", T0 - age, T0 - age), T0)
    d.merge(new_doc(3).delete(f"peer/{PIDS[3]}/last_seen", T0), T0)
    assert d.members(T0, ttl_ms=10_000) == {P1: T0 - 1_000}


def test_persistence_round_trip_and_verification(doc):
    doc.delete(f"peer/{PIDS[3]}/addrs", T0 + 10)
    doc.set(f"peer/{PIDS[3]}/stats", {"tok_s": 1234.5, "step": 7}, T0 + 20)
    doc.gc(T0 + 15, horizon_ms=10)
    blob = doc.to_bytes()
    back = RunDocument.from_bytes(blob, RUN, SIGNERS[3], ADMINS)
    assert back.digest() == doc.digest()
    assert list(back.items()) == list(doc.items())
    assert back.encode_delta(back.entries()) == doc.encode_delta(doc.entries())
    assert back.floor_ms == doc.floor_ms and back.hlc.last == doc.hlc.last
    back.set(f"peer/{PIDS[3]}/stats", {}, T0 - 10_000)  # clock went back across the restart
    assert back.entry(f"peer/{PIDS[3]}/stats").hlc > doc.entry(f"peer/{PIDS[3]}/stats").hlc
    sig = doc.entry("run/settings/lr").signature
    tampered = blob.replace(sig, sig[:-1] + bytes([sig[-1] ^ 1]))
    for bad, who in [(tampered, RUN), (blob, "run-2"), (blob[:-3], RUN), (b"\x00", RUN)]:
        with pytest.raises(RemoteProtocolError):
            RunDocument.from_bytes(bad, who, SIGNERS[3], ADMINS)
