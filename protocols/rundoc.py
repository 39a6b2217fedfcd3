"""The run document: a signed last-writer-wins map, replicated as a delta-state CRDT.

Every entry is `key -> value` stamped with a hybrid logical clock and signed by its writer
over (run id, key, value, stamp, tombstone); a merge keeps, per key, the entry with the
highest `(stamp, signature)`. That order is total, so merging is a join: commutative,
associative, idempotent. A remote entry is applied only if it is well formed, its writer may
write its key (`authorize`), its signature verifies, and its stamp is not far in the future.

Deltas travel as msgpack `[1, run_id, [[key, packed_value, wall_ms, counter, writer,
tombstone, signature], ...]]` (gossip); anti-entropy is `summary()` / `delta_since()`
over hashed key buckets (a stream, one round trip each way). docs/rundoc.md has the why,
the namespaces and the GC horizon rules. Sans-IO: callers pass `now_ms`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from protocols.errors import LocalProtocolError, RemoteProtocolError
from protocols.keys import SIGNATURE_BYTES, Signer, public_key_from_peer_id, verify
from protocols.limits import StreamLimits

#: Anti-entropy: summary -> delta + summary -> delta, one round trip each way.
PROTOCOL_ID = "/peertrain/meta/1.0.0"
MAX_DELTA_BYTES = (1 << 20) - 4096  # one wire frame / gossipsub message (1 MiB)
#: Both sides read the same stream: a summary (<= 10 KiB) or a delta (<= 1 MiB) in one
#: envelope with room to spare, never a tensor.
SYNC_LIMITS = StreamLimits(PROTOCOL_ID, 2 << 20, deadline_s=10.0)
#: One delta gossiped on `/peertrain/<run-id>/meta/1`, checked on its length (decode_delta).
GOSSIP_LIMITS = StreamLimits("/peertrain/<run-id>/meta/1", MAX_DELTA_BYTES, framed=False,
                             note="none: a gossip message arrives whole")
VERSION = 1
DOMAIN = "peertrain/rundoc/1"  # first field of every signed payload: no cross-protocol reuse
MAX_KEY_BYTES = 256
MAX_COUNTER = 2**32 - 1
MAX_WALL_MS = 2**53  # JS-safe integer; ~285,000 years
BUCKETS = 1024  # anti-entropy: at 6,000 entries a one-key difference resends ~6 of them
_SEGMENT = r"[\x21-\x2e\x30-\x7e]+"  # printable ASCII, no space, no "/"
_KEY_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
_NIL = msgpack.packb(None)


class Stamp(NamedTuple):
    """A hybrid logical clock reading; tuples order by (wall_ms, counter, node)."""

    wall_ms: int
    counter: int
    node: str


class HLC:
    """Hybrid logical clock (Kulkarni et al. 2014): never goes back, stays near wall time."""

    def __init__(self, node: str, max_drift_ms: int = 60_000) -> None:
        self.node, self.max_drift_ms = node, max_drift_ms
        self.last = Stamp(0, 0, node)

    def tick(self, now_ms: int) -> Stamp:
        """A stamp for a local event, greater than every stamp issued or observed."""
        wall = max(self.last.wall_ms, now_ms)
        return self._advance(wall, self.last.counter + 1 if wall == self.last.wall_ms else 0)

    def observe(self, remote: Stamp, now_ms: int) -> Stamp:
        """Fold in a remote stamp; RemoteProtocolError if it is > max_drift_ms ahead of now."""
        if remote.wall_ms > now_ms + self.max_drift_ms:
            raise RemoteProtocolError(
                f"stamp {remote.wall_ms} is {remote.wall_ms - now_ms} ms ahead of our clock"
                f" (max drift {self.max_drift_ms} ms)"
            )
        last = self.last
        wall = max(last.wall_ms, remote.wall_ms, now_ms)
        if wall == last.wall_ms == remote.wall_ms:
            counter = max(last.counter, remote.counter) + 1
        elif wall == last.wall_ms:
            counter = last.counter + 1
        elif wall == remote.wall_ms:
            counter = remote.counter + 1
        else:
            counter = 0
        return self._advance(wall, counter)

    def _advance(self, wall: int, counter: int) -> Stamp:
        if counter > MAX_COUNTER:  # 2^32 events in one ms: borrow a millisecond
            wall, counter = wall + 1, 0
        self.last = Stamp(wall, counter, self.node)
        return self.last


@dataclass(frozen=True, slots=True)
class Entry:
    """One signed key; `packed` is the msgpack of the value exactly as signed."""

    key: str
    packed: bytes
    hlc: Stamp
    tombstone: bool
    signature: bytes

    @property
    def writer(self) -> str:
        return self.hlc.node

    @property
    def value(self) -> Any:
        """A fresh copy of the value (None for a tombstone); RemoteProtocolError if garbled."""
        return _unpack(self.packed, "value")

    @property
    def order(self) -> tuple[Stamp, bytes]:
        """Last-writer-wins order; the signature breaks ties between equal stamps."""
        return (self.hlc, self.signature)


def signed_payload(run_id: str, key: str, packed: bytes, hlc: Stamp, tombstone: bool) -> bytes:
    return msgpack.packb([DOMAIN, run_id, key, packed, *hlc, tombstone])


def sign_entry(
    run_id: str, signer: Signer, key: str, value: Any, hlc: Stamp, tombstone: bool = False
) -> Entry:
    """Build and sign an entry (unchecked: `RunDocument.set` is the checked path)."""
    packed = _NIL if tombstone else msgpack.packb(value, use_bin_type=True)
    hlc = Stamp(hlc.wall_ms, hlc.counter, signer.peer_id)
    sig = signer.sign(signed_payload(run_id, key, packed, hlc, tombstone))
    return Entry(key, packed, hlc, tombstone, sig)


def authorize(entry: Entry, admins: frozenset[str] | set[str]) -> str | None:
    """None if `entry.writer` may write `entry.key`, else the reason. Pure; no signatures.

    peer/<id>/<name...>   only <id>             stage/<n>        admins (the stage plan)
    run/<name...>         admins                stage/<n>/<id>   only <id> (its claim on n)
    ckpt/<cid>            anyone; the value is a map whose "hash" is <cid>; deletion: admins
    peer/<id>/ckpt/<cid>  only <id>, the same hash rule; <id> deletes it (retention)
    """
    key, writer = entry.key, entry.writer
    if not _KEY_RE.fullmatch(key) or len(key.encode()) > MAX_KEY_BYTES:
        return "malformed key"
    parts = key.split("/")
    head, n = parts[0], len(parts)
    if head == "peer" and n >= 3:
        if parts[1] != writer:
            return f"only {parts[1]} may write its peer/ namespace"
        if n == 4 and parts[2] == "ckpt" and not entry.tombstone:
            return _hash_problem(entry, parts[3])
        return None
    if head == "run" and n >= 2:
        return None if writer in admins else "run/ keys are writable by admins only"
    if head == "stage" and n in (2, 3) and parts[1].isdecimal():
        if n == 2:
            return None if writer in admins else "stage/<n> is writable by admins only"
        return None if parts[2] == writer else f"only {parts[2]} may claim {key}"
    if head == "ckpt" and n == 2:
        if entry.tombstone:
            return None if writer in admins else "ckpt/ entries are deleted by admins only"
        return _hash_problem(entry, parts[1])
    return "unknown key namespace"


def _hash_problem(entry: Entry, cid: str) -> str | None:
    """A checkpoint entry's value must be a map whose "hash" is the cid in its key."""
    try:
        value = entry.value
    except RemoteProtocolError as e:
        return str(e)
    if not isinstance(value, dict) or value.get("hash") != cid:
        return f"ckpt value's hash field must equal {cid!r}"
    return None


def ckpt_key(peer: str, cid: str) -> str:
    """Where a peer announces a checkpoint it wrote: its own namespace, so that it can
    delete the entry when retention drops the checkpoint, and GC drops it with the peer."""
    return f"peer/{peer}/ckpt/{cid}"


def checkpoint_index(doc: RunDocument) -> list[tuple[int, str, str]]:
    """(step, cid, writer) of every checkpoint the document lists (`ckpt/<cid>` and
    `peer/<id>/ckpt/<cid>`), oldest step first. Steps are only as true as their writer."""
    found = []
    for e in doc.entries():
        parts = e.key.split("/")
        if e.tombstone or not (
            (parts[0] == "ckpt" and len(parts) == 2)
            or (parts[0] == "peer" and len(parts) == 4 and parts[2] == "ckpt")
        ):
            continue
        value = e.value
        step = value.get("step", 0)
        found.append((step if _is_int(step) else 0, parts[-1], e.writer))
    return sorted(found)


def checkpoint_holders(doc: RunDocument, cid: str) -> tuple[list[str], str | None]:
    """(the peers announcing checkpoint `cid` under their own namespace, sorted; its
    writer). A peer that pulled a checkpoint announces it too, naming its `writer` in the
    value; the writer is the announcer that names none (or itself), else the writer the
    holders name (None if none is listed)."""
    holders: list[str] = []
    named: list[str] = []
    for e in doc.entries("peer/"):
        parts = e.key.split("/")
        if e.tombstone or len(parts) != 4 or parts[2] != "ckpt" or parts[3] != cid:
            continue
        holders.append(parts[1])
        value = e.value
        claimed = value.get("writer") if isinstance(value, dict) else None
        if claimed in (None, parts[1]):
            named.insert(0, parts[1])
        elif isinstance(claimed, str):
            named.append(claimed)
    return sorted(holders), (named[0] if named else None)


@dataclass(slots=True)
class MergeResult:
    applied: list[str] = field(default_factory=list)  # keys whose value changed
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (key, reason)


@dataclass(frozen=True, slots=True)
class Statistics:
    entries: int
    tombstones: int
    floor_ms: int
    clock: Stamp


class RunDocument:
    """One replica of a run's document, writing as `signer`; `admins` come from the manifest.

    Bounds (constructor arguments): `max_entries` keys including tombstones (a new key past
    it is rejected), `max_value_bytes` per packed value, `max_delta_bytes` per encoded delta
    (checked before decoding), `max_drift_ms` of clock lead accepted from a remote stamp.
    Anti-entropy needs one key bucket to fit a delta: max_entries / 1024 * max_value_bytes
    (the defaults: 64 * 8 KiB = 512 KiB < 1 MiB).
    """

    def __init__(
        self,
        run_id: str,
        signer: Signer,
        admins: Iterable[str],
        *,
        max_entries: int = 65_536,
        max_value_bytes: int = 8 * 1024,
        max_delta_bytes: int = MAX_DELTA_BYTES,
        max_drift_ms: int = 60_000,
    ) -> None:
        self.run_id, self.signer, self.admins = run_id, signer, frozenset(admins)
        for admin in self.admins:
            try:
                public_key_from_peer_id(admin)
            except RemoteProtocolError as e:
                raise LocalProtocolError(f"bad admin in manifest: {e}") from None
        self.max_entries, self.max_value_bytes = max_entries, max_value_bytes
        self.max_delta_bytes = max_delta_bytes
        self.hlc = HLC(signer.peer_id, max_drift_ms)
        self.floor_ms = 0  # GC horizon: unknown peer/ keys with older stamps are refused
        self._entries: dict[str, Entry] = {}

    # -- local writes: each returns the delta to gossip -------------------------------------

    def set(self, key: str, value: Any, now_ms: int) -> bytes:
        return self._write(key, value, False, now_ms)

    def delete(self, key: str, now_ms: int) -> bytes:
        return self._write(key, None, True, now_ms)

    def _write(self, key: str, value: Any, tombstone: bool, now_ms: int) -> bytes:
        try:  # values must survive the trip: what we sign is what every replica reads
            packed = msgpack.packb(value, use_bin_type=True)
            _unpack(packed, "value")
        except (TypeError, ValueError, OverflowError, RemoteProtocolError) as e:
            raise LocalProtocolError(f"{key}: value is not portable msgpack: {e}") from None
        if len(packed) > self.max_value_bytes:
            raise LocalProtocolError(f"{key}: value is {len(packed)} B > {self.max_value_bytes}")
        probe = Entry(key, packed, Stamp(0, 0, self.signer.peer_id), tombstone, b"")
        if reason := authorize(probe, self.admins):
            raise LocalProtocolError(f"{key}: {reason}")
        if key not in self._entries and len(self._entries) >= self.max_entries:
            raise LocalProtocolError(f"document full ({self.max_entries} entries)")
        entry = sign_entry(self.run_id, self.signer, key, value, self.hlc.tick(now_ms), tombstone)
        self._entries[key] = entry
        return self.encode_delta([entry])

    # -- reads --------------------------------------------------------------------------------

    def entry(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def get(self, key: str, default: Any = None) -> Any:
        e = self._entries.get(key)
        return default if e is None or e.tombstone else e.value

    def entries(self, prefix: str = "") -> Iterator[Entry]:
        """Every entry under `prefix`, tombstones included, in key order (for encode_delta)."""
        return (self._entries[k] for k in sorted(self._entries) if k.startswith(prefix))

    def items(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        """Live (key, value) pairs under `prefix`, in key order."""
        return ((e.key, e.value) for e in self.entries(prefix) if not e.tombstone)

    def members(self, now_ms: int, ttl_ms: int) -> dict[str, int]:
        """Peers whose own `peer/<id>/last_seen` entry was written within `ttl_ms`: id -> ms."""
        out = {}
        for key, e in self._entries.items():
            parts = key.split("/")
            fresh = not e.tombstone and now_ms - e.hlc.wall_ms <= ttl_ms
            if fresh and parts[0] == "peer" and parts[2:] == ["last_seen"]:
                out[parts[1]] = e.hlc.wall_ms
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def digest(self) -> bytes:
        """32 bytes naming the exact state: equal digests, equal documents."""
        h = hashlib.blake2b(digest_size=32)
        for key in sorted(self._entries):
            h.update(msgpack.packb([key, self._entries[key].signature]))
        return h.digest()

    def statistics(self) -> Statistics:
        tombs = sum(e.tombstone for e in self._entries.values())
        return Statistics(len(self._entries), tombs, self.floor_ms, self.hlc.last)

    # -- remote input -------------------------------------------------------------------------

    def merge(self, delta: bytes, now_ms: int) -> MergeResult:
        """Apply a remote delta. Bad entries are listed in `rejected` and change nothing;
        an undecodable delta, another run's, raises RemoteProtocolError."""
        result = MergeResult()
        for e in self.decode_delta(delta):
            if reason := self._admit(e, now_ms):
                result.rejected.append((e.key, reason))
            elif self._entries.get(e.key) is e:
                result.applied.append(e.key)
        return result

    def _admit(self, e: Entry, now_ms: int | None) -> str | None:
        """Store `e` if it wins; the reason if it is refused; None if valid or stale."""
        if e.tombstone and e.packed != _NIL:
            return "tombstone carries a value"
        if len(e.packed) > self.max_value_bytes:
            return f"value is {len(e.packed)} B > {self.max_value_bytes}"
        if reason := authorize(e, self.admins):
            return reason
        if not e.tombstone:
            try:
                _unpack(e.packed, "value")
            except RemoteProtocolError as exc:
                return str(exc)
        if now_ms is not None and e.hlc.wall_ms > now_ms + self.hlc.max_drift_ms:
            return f"stamp {e.hlc.wall_ms - now_ms} ms in the future"
        old = self._entries.get(e.key)
        if old is None:
            if e.hlc.wall_ms < self.floor_ms and owner_of(e.key) is not None:
                return "older than the GC horizon for an unknown key"
            if len(self._entries) >= self.max_entries:
                return f"document full ({self.max_entries} entries)"
        elif e.order <= old.order:
            return None  # a duplicate or a loser: nothing to check, nothing changes
        try:
            good = verify(
                e.writer,
                signed_payload(self.run_id, e.key, e.packed, e.hlc, e.tombstone),
                e.signature,
            )
        except RemoteProtocolError as exc:
            return str(exc)
        if not good:
            return "bad signature"
        if now_ms is not None:
            self.hlc.observe(e.hlc, now_ms)  # cannot raise: drift was checked above
        self._entries[e.key] = e
        return None

    # -- wire ---------------------------------------------------------------------------------

    def encode_delta(self, entries: Iterable[Entry]) -> bytes:
        rows = [[e.key, e.packed, *e.hlc, e.tombstone, e.signature] for e in entries]
        data = msgpack.packb([VERSION, self.run_id, rows], use_bin_type=True)
        if len(data) > self.max_delta_bytes:
            raise LocalProtocolError(f"delta is {len(data)} B > {self.max_delta_bytes}")
        return data

    def decode_delta(self, data: bytes) -> list[Entry]:
        """Parse a delta (structure only: `merge` verifies). RemoteProtocolError if malformed."""
        rows = self._envelope(data, self.max_delta_bytes, 3, "delta")[2]
        if not isinstance(rows, list):
            raise RemoteProtocolError("delta entries are not a list")
        return [_entry_from_row(row) for row in rows]

    def _envelope(self, data: bytes, limit: int, n: int, what: str) -> list:
        if not isinstance(data, bytes | bytearray) or len(data) > limit:
            raise RemoteProtocolError(f"{what} larger than {limit} B")
        msg = _unpack(data, what)
        if not isinstance(msg, list) or len(msg) != n or msg[0] != VERSION:
            raise RemoteProtocolError(f"{what} is not a version-{VERSION} run document {what}")
        if msg[1] != self.run_id:
            raise RemoteProtocolError(f"{what} is for run {msg[1]!r:.80}, not {self.run_id!r}")
        return msg

    # -- anti-entropy: A sends summary(), B answers delta_since(it), and the same B -> A -----

    def summary(self) -> bytes:
        """Per non-empty key bucket, (index u16, XOR of its entries' hashes u64): <= 10 KiB."""
        sparse = b"".join(i.to_bytes(2) + h.to_bytes(8) for i, h in enumerate(self._buckets()) if h)
        return msgpack.packb([VERSION, self.run_id, sparse])

    def delta_since(self, summary: bytes) -> bytes:
        """Our entries in every bucket where `summary` differs from us: whole buckets in
        index order up to max_delta_bytes, so a capped answer still makes progress."""
        sparse = self._envelope(summary, 64 + len(self.run_id) + 10 * BUCKETS, 3, "summary")[2]
        if not isinstance(sparse, bytes) or len(sparse) % 10:
            raise RemoteProtocolError("summary buckets malformed")
        theirs: dict[int, int] = {}
        for j in range(0, len(sparse), 10):
            i = int.from_bytes(sparse[j : j + 2])
            if i >= BUCKETS or i in theirs:
                raise RemoteProtocolError("summary buckets malformed")
            theirs[i] = int.from_bytes(sparse[j + 2 : j + 10])
        by_bucket: dict[int, list[Entry]] = {}
        for key in sorted(self._entries):
            by_bucket.setdefault(_bucket(key), []).append(self._entries[key])
        out: list[Entry] = []
        mine, size = self._buckets(), 64 + len(self.run_id)
        for i in sorted(by_bucket):
            if mine[i] == theirs.get(i, 0):
                continue
            cost = [len(e.packed) + len(e.key) + len(e.writer) + 110 for e in by_bucket[i]]
            if size + sum(cost) > self.max_delta_bytes:
                if not out:  # one bucket over the cap: send what fits (max_delta_bytes too low)
                    for e, c in zip(by_bucket[i], cost, strict=True):
                        if (size := size + c) > self.max_delta_bytes:
                            break
                        out.append(e)
                break
            out += by_bucket[i]
            size += sum(cost)
        return self.encode_delta(out)

    def _buckets(self) -> list[int]:
        acc = [0] * BUCKETS
        for key, e in self._entries.items():
            acc[_bucket(key)] ^= int.from_bytes(hashlib.blake2b(e.signature).digest()[:8])
        return acc

    # -- persistence and GC -------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        rows = [[e.key, e.packed, *e.hlc, e.tombstone, e.signature] for e in self._entries.values()]
        clock = [self.hlc.last.wall_ms, self.hlc.last.counter]
        return msgpack.packb([VERSION, self.run_id, self.floor_ms, clock, rows])

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        run_id: str,
        signer: Signer,
        admins: Iterable[str],
        *,
        max_bytes: int = 1 << 30,
        **limits: int,
    ) -> RunDocument:
        """Reload `to_bytes()`, re-verifying every entry; RemoteProtocolError if any fails."""
        doc = cls(run_id, signer, admins, **limits)
        _, _, floor, clock, rows = doc._envelope(data, max_bytes, 5, "state")
        if not (
            _is_int(floor)
            and isinstance(clock, list)
            and len(clock) == 2
            and all(map(_is_int, clock))
            and isinstance(rows, list)
        ):
            raise RemoteProtocolError("state header malformed")
        entries = [_entry_from_row(row) for row in rows]
        if len({e.key for e in entries}) != len(entries):
            raise RemoteProtocolError("state holds a key twice")
        for e in entries:
            if reason := doc._admit(e, None):
                raise RemoteProtocolError(f"state entry {e.key!r}: {reason}")
        seen = [(e.hlc.wall_ms, e.hlc.counter) for e in entries]
        wall, counter = max([tuple(clock), *seen])  # never reissue a stamp after a restart
        doc.hlc.last, doc.floor_ms = Stamp(wall, counter, signer.peer_id), floor
        return doc

    def gc(self, now_ms: int, horizon_ms: int) -> int:
        """Forget what `compactable` names (every key owned by a peer silent for >
        horizon_ms, old tombstones of owned keys); from now on refuse owned entries that
        old for keys we have no record of. Returns the count."""
        drop = compactable(self._entries.values(), now_ms, horizon_ms)
        for key in drop:
            del self._entries[key]
        self.floor_ms = max(self.floor_ms, now_ms - horizon_ms)
        return len(drop)

    def stale_own(self, now_ms: int, older_than_ms: int) -> list[Entry]:
        """Our own live entries (`owner_of` is us) stamped more than `older_than_ms` ago:
        the ones to re-sign (`refresh`) so that no live entry of ours falls under a
        replica's compaction floor (pass half the horizon or less). In key order."""
        me = self.signer.peer_id
        return sorted((e for e in self._entries.values() if not e.tombstone
                       and e.hlc.wall_ms < now_ms - older_than_ms and owner_of(e.key) == me),
                      key=lambda e: e.key)

    def refresh(self, now_ms: int, older_than_ms: int) -> bytes | None:
        """Re-sign `stale_own` entries with their values unchanged and a fresh stamp; the
        delta to gossip, or None when none is stale."""
        stale = self.stale_own(now_ms, older_than_ms)
        for e in stale:
            self._write(e.key, e.value, False, now_ms)
        return self.encode_delta([self._entries[e.key] for e in stale]) if stale else None

    def caught_up(self, summary: bytes) -> bool:
        """True when every bucket where `summary` (a peer's, after we merged its answer)
        differs from ours holds a key of our own (`owner_of`: which the peer may lack until
        it merges our answer): we hold everything the peer summarized. A capped answer (a
        document over max_delta_bytes) leaves other buckets unequal."""
        sparse = self._envelope(summary, 64 + len(self.run_id) + 10 * BUCKETS, 3, "summary")[2]
        if not isinstance(sparse, bytes) or len(sparse) % 10:
            raise RemoteProtocolError("summary buckets malformed")
        theirs = {int.from_bytes(sparse[j:j + 2]): int.from_bytes(sparse[j + 2:j + 10])
                  for j in range(0, len(sparse), 10)}
        ours = self._buckets()
        differ = {i for i in range(BUCKETS) if ours[i] != theirs.get(i, 0)}
        me = self.signer.peer_id
        own = {_bucket(k) for k in self._entries if owner_of(k) == me}
        return differ <= own


def owner_of(key: str) -> str | None:
    """The peer whose own key this is (`peer/<id>/...`, `stage/<n>/<id>`: only it may
    write it), or None for the run's keys (run/, stage/<n>, ckpt/). Compaction goes by it."""
    parts = key.split("/")
    if parts[0] == "peer" and len(parts) >= 3:
        return parts[1]
    if parts[0] == "stage" and len(parts) == 3:
        return parts[2]
    return None


def compactable(entries: Iterable[Entry], now_ms: int, horizon_ms: int) -> list[str]:
    """The compaction rule (pure; the simulator calls it too): with cutoff = now_ms -
    horizon_ms, the keys of
    * every entry, live or not, owned by a peer (`owner_of`: its `peer/<id>/...` keys and
      its `stage/<n>/<id>` claims) whose newest owned stamp is before the cutoff: a peer
      silent that long has left (a crashed one never deletes its keys, and nobody else
      may);
    * tombstones of owned keys stamped before the cutoff.
    Only owned keys: the run's own keys (run/, stage/<n>, ckpt/) are written by admins or
    content-addressed, few, and kept with their tombstones, so an old one is never refused
    and never comes back. A function of the entries' signed stamps only, so replicas
    holding the same entries drop the same keys; each does so when its own clock passes
    the cutoff and refuses unknown owned keys older than it afterwards (`floor_ms`), so a
    replica that has not compacted yet cannot bring them back. A live peer re-signs its
    own entries before they are a quarter of a horizon old (`refresh`), so none of a live
    peer's entries is ever under anybody's floor. Sorted, for a deterministic order."""
    cutoff = now_ms - horizon_ms
    owned = [(e, o) for e in entries if (o := owner_of(e.key)) is not None]
    newest: dict[str, int] = {}
    for e, o in owned:
        newest[o] = max(newest.get(o, e.hlc.wall_ms), e.hlc.wall_ms)
    return sorted(e.key for e, o in owned
                  if e.hlc.wall_ms < cutoff and (e.tombstone or newest[o] < cutoff))


def _unpack(data: bytes, what: str) -> Any:
    try:  # msgpack caps every length at len(data), so allocation is bounded by the input
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise RemoteProtocolError(f"undecodable {what}: {e}") from None


def _is_int(x: Any) -> bool:
    return type(x) is int and 0 <= x <= MAX_WALL_MS


def _entry_from_row(row: Any) -> Entry:
    if not (isinstance(row, list) and len(row) == 7):
        raise RemoteProtocolError("entry is not a 7-element list")
    key, packed, wall, counter, writer, tomb, sig = row
    if not (
        isinstance(key, str)
        and isinstance(packed, bytes)
        and isinstance(writer, str)
        and _is_int(wall)
        and _is_int(counter)
        and counter <= MAX_COUNTER
        and type(tomb) is bool
        and isinstance(sig, bytes)
        and len(sig) == SIGNATURE_BYTES
    ):
        raise RemoteProtocolError(f"entry {key!r:.80} malformed")
    return Entry(key, packed, Stamp(wall, counter, writer), tomb, sig)


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest()) % BUCKETS
