"""Adapter for `/peertrain/avg/1.0.0`: pairwise weight exchange for NoLoCo rounds.

The sans-IO protocol (protocols/averaging.py) says what is sent; this module decides with
whom and when, and pumps a libp2p stream through it:

* Pairing: round r's groups are a deterministic function of r and the sorted live
  membership (node/ml/optim/pairing.py), so both sides agree without a coordinator. Within a
  group the peer with the smaller id dials. If views differ, the responder rejects an
  initiator that is not in its group, and both fall back to a local step.
* Deadlines come from measurements, not constants (estimates.py): each partner's observed
  throughput (EWMA) gives the expected transfer time of our vector, and the trainer's
  measured step time gives the slack for a partner that reaches the round boundary a
  little later.
* A partner that is gone, slow, rejects, or sends anything invalid (wrong shape, NaN/Inf,
  unknown codec, truncated frame) costs one local outer step and a logged reason.
* `outer.codec = "topk"`: the snapshot is a `Compressed` (the trainer's encoded sparse
  frame), sent and received as the codec "topk" (protocols/averaging.py), and what comes
  back are the partner's decoded frames. A partner that does not speak topk (an older
  node: it answers with the dense fallback) is not averaged with: the round is local on
  both sides (our trainer holds no dense θ to send, and its error feedback keeps what the
  frame did not carry), logged once per partner. DiLoCo's all-reduce becomes an
  all-gather of the frames along the same plan (`allreduce`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from node.averaging import adapt
from node.averaging.estimates import ExchangeEstimates, Progress
from node.training.rounds import Compressed, Outcome
from node.transport.lane import LaneListener, connect_lane, listen_host
from node.transport.streams import ByteStream, close_quietly, pump, write_chunks
from node.transport.transports import Transports
from p2p.host import Substrate
from protocols import averaging as av
from protocols import codecs as _codecs
from protocols import sparse
from protocols.errors import RemoteProtocolError

log = logging.getLogger("node.averaging")

PROTOCOL_ID = av.PROTOCOL_ID
MAX_IN_FLIGHT = 2  # exchanges with one partner at once (rounds may be shorter than one)
HANDSHAKE_RTTS = 6  # round trips before the first vector byte, with margin (deadline)
ALLREDUCE_STEPS = 64  # DiLoCo: step k of round r's all-reduce is exchange round r * 64 + k
LANE_RETRY_S = 300.0  # a partner whose bulk lane failed gets the libp2p stream this long


@dataclass
class _Round:
    snapshot: Any = None
    ready: trio.Event = field(default_factory=trio.Event)
    inbound: dict[str, Any] = field(default_factory=dict)
    inbound_done: dict[str, trio.Event] = field(default_factory=dict)


class Averager:
    """The exchange service. Built with what it needs (a benchmark or a test drives one on
    a bare host); in a node it also runs as a service, which gossips SybilWall histories
    to each round's neighbours after the round (`after_round`) without delaying it."""

    name = "averaging"
    protocols = (PROTOCOL_ID,)

    def __init__(self, substrate: Substrate, run_id: str, me: str,
                 members: Callable[[], list[str]], *, codecs: list[str], group_size: int = 2,
                 step_time: Callable[[], float] = lambda: 0.1, inner_steps: int = 50,
                 stats: Any = None, lanes: bool = True, neighbours: int | None = None,
                 fixed_neighbours: list[str] | None = None,
                 after_round: Callable[[list[str]], Awaitable[None]] | None = None,
                 transports: Transports | None = None, auto_codec: bool = False,
                 all_reduce: bool = False,
                 relay_limit: int | None = None,
                 topk_bounds: sparse.Bounds | None = None,
                 dial: Callable[[str], Awaitable[object]] | None = None) -> None:
        # This thread's own torch work (bf16/int8 conversion, the NaN check) runs on one
        # core: torch's thread count is per calling thread, and the default (every core)
        # made its OpenMP workers spin against the trainer's. A 100 MB bf16 exchange cost
        # 0.4 s of CPU per side with the default and 0.2 s with one thread.
        torch.set_num_threads(1)
        self.substrate = substrate
        self.run_id = run_id
        self.me = me
        self.members = members
        # Partners come from the whole live view, not the connected set; as initiator we
        # connect to one we hold no connection to first (membership.redial.dial_partner).
        self.dial = dial
        self._recent: dict[int, list[str]] = {}  # round -> its partners, the last few
        self.codecs = codecs  # what we accept as responder, in our order of preference
        # "topk" (a run with outer.codec = "topk"): frames are checked against these bounds
        self.topk = av.TOPK in codecs
        self.topk_bounds = topk_bounds if topk_bounds is not None else sparse.Bounds()
        self._no_topk_logged: set[str] = set()  # partners whose dense fallback was logged
        # `outer.codec = "auto"` (adapt.py): as initiator, offer what the path calls for
        self.auto_codec = auto_codec
        self.group_size = group_size
        self.neighbours = neighbours  # gossip learning: k neighbours instead of groups
        # A fixed topology (NodeConfig.neighbours: testnets, tests) replaces both.
        self.fixed_neighbours = fixed_neighbours
        self.step_time = step_time
        self.inner_steps = inner_steps
        self.stats = stats  # TrainingStats: bytes_sent / bytes_received live there
        # each partner's measured link and this node's exchange seconds (estimates.py)
        self.estimates = ExchangeEstimates()
        self.partners = self.estimates.partners
        self.exchange_seconds = self.estimates.seconds
        self._progress: dict[tuple[int, str], Progress] = {}  # (round, partner) -> swap
        self._rounds: dict[int, _Round] = {}
        self._current = 0
        # Bulk lanes (protocols/lane.py) unless disabled, or a partner's lane failed in the
        # last LANE_RETRY_S: then that partner gets the libp2p stream (which also crosses
        # relays and NATs). Partner -> when its lane failed (time.monotonic()).
        self.lanes = lanes
        self.lane_failed: dict[str, float] = {}
        self.lane_host = listen_host(substrate)
        # How each partner is reached (node/transport/transports.py): its streams (a data
        # channel to a peer reached only through a relay, counted apart below), its path
        # kind, its measured round trip. A lane is a fresh TCP dial to the partner's
        # address, so only a `direct` path has one: a punched NAT forwards the punched port
        # alone, and a lane dialled there waited out every round. As responder we accept a
        # lane only where the partner can reach a fresh port of ours (`lane_dialable`):
        # from behind a NAT, or a UPnP mapping of the libp2p port alone, the partner's dial
        # timed out and the round was lost (measured: `node bench paths`).
        self.transports = transports or Transports(substrate)
        # The manifest's network.relay_exchange_mb in bytes (None: no limit): a partner
        # reached only through a relay is averaged with only while the codec's payload
        # fits; else both sides take a local step at once, as both see the relayed path.
        self.relay_limit = relay_limit
        self.after_round = after_round
        self._in_flight: Counter[str] = Counter()  # partner -> exchanges under way
        # DiLoCo (`allreduce`): each round is an all-reduce of pairwise swaps, planned from
        # the membership when our trainer reaches the boundary (round -> our steps).
        self.all_reduce = all_reduce
        self._plans: dict[int, list[Any]] = {}
        self._nursery: trio.Nursery | None = None
        self.transports.serve(PROTOCOL_ID, self.handle)

    async def run(self, ctx: object = None, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def statistics(self) -> dict[str, Any]:
        return {"partners": {p: {"mb_per_s": round(s.bytes_per_s / 1e6, 1),
                                 "wire_mb_per_s": None if s.wire_bytes_per_s is None
                                 else round(s.wire_bytes_per_s / 1e6, 2),
                                 "codec": s.last_codec, "kept_off_relay": s.kept_off_relay,
                                 "exchanges": s.exchanges, "failures": s.failures,
                                 "bytes_sent": dict(s.sent), "bytes_received": dict(s.received),
                                 "last_exchange_unix": s.last_exchange_unix,
                                 "last_seconds": s.last_seconds}
                             for p, s in sorted(self.partners.items())},
                "exchange_seconds": self.exchange_seconds.snapshot(),
                "lane_failed": sorted(self.lane_failed)}

    # -- helpers ----------------------------------------------------------------------

    def _round(self, r: int) -> _Round:
        slot = self._rounds.get(r)
        if slot is None:
            slot = self._rounds[r] = _Round()
            for old in [k for k in self._rounds if k < r - 2]:  # bounded: a few rounds kept
                del self._rounds[old]
        return slot

    def group(self, r: int) -> list[str]:
        """Round r's partners: NoLoCo's group, or gossip learning's k neighbours."""
        from node.ml.optim import allreduce
        from node.ml.optim.pairing import group_of, neighbours_of

        peers = sorted({*self.members(), self.me})
        if self.all_reduce:
            outer, k = divmod(r, ALLREDUCE_STEPS)
            steps = self._plans.get(outer) or allreduce.plan(self.me, peers)
            return [s.partner for s in steps if s.k == k]
        if self.fixed_neighbours:
            return [p for p in self.fixed_neighbours if p in peers and p != self.me]
        if self.neighbours is not None:
            return neighbours_of(self.me, r, peers, self.neighbours)
        return [p for p in group_of(self.me, r, peers, self.group_size) if p != self.me]

    def _lane_for(self, partner: str) -> bool:
        """Offer a bulk lane to `partner`? Not for LANE_RETRY_S after one failed: a lane
        that failed (a firewall, a NAT) usually fails again, but networks change. Never
        over a relayed connection: its remote address is the relay's, so the lane would
        dial the relay's IP (and lose the round) instead of the partner."""
        if self.transports.path_of(partner) != "direct":
            return False
        failed = self.lane_failed.get(partner)
        if failed is not None and time.monotonic() - failed >= LANE_RETRY_S:
            del self.lane_failed[partner]
            failed = None
        return self.lanes and failed is None

    def _over_relay_limit(self, partner: str, numel: int) -> str | None:
        """Why `partner` is not averaged with now, if it is reached only through a relay
        and our payload to it is over the run's relay limit; else None."""
        path = self.transports.path_of(partner)
        if self.relay_limit is None or not path.startswith("relayed"):
            return None
        setting = adapt.AUTO if self.auto_codec else self.codecs[0]
        codec = adapt.offer(setting, numel, path=path, wire_rate=None, round_s=0.0)[0]
        size = self._payload_bytes(codec, numel)
        if size <= self.relay_limit:
            return None
        return (f"reached only {path}: a {codec} exchange of {size / 1e6:.1f} MB is over "
                f"the run's network.relay_exchange_mb ({self.relay_limit / 1e6:.1f} MB)")

    def _kept_off_relay(self, partner: str, numel: int) -> bool:
        """`_over_relay_limit`, counted per partner and logged the first time."""
        why = self._over_relay_limit(partner, numel)
        if why is None:
            return False
        st = self.estimates.of(partner)
        if not st.kept_off_relay:
            log.info("%s %s; local steps until a direct, punched or webrtc path appears",
                     partner, why)
        st.kept_off_relay += 1
        return True

    def deadline(self, partner: str, numel: int) -> float:
        """Seconds an exchange of `numel` values with `partner` may take (estimates.py): the
        transfer, HANDSHAKE_RTTS of its measured round trip (opening the stream, offer and
        accept, the lane's dial), and the skew a partner may have at the boundary."""
        return self.estimates.deadline(
            partner, numel, expected_s=self.expected_exchange_s(numel),
            skew_s=0.5 * self.inner_steps * self.step_time(),
            rtt_s=self.transports.rtt_s(partner) or 0.0, handshake_rtts=HANDSHAKE_RTTS)

    def expected_exchange_s(self, numel: int) -> float:
        """Seconds one exchange of `numel` values takes: the EWMA of those measured, or
        before the first, the codec's payload both ways at the prior wire rate."""
        codec = "bf16" if self.auto_codec else self.codecs[0]
        return self.estimates.expected_s(self._payload_bytes(codec, numel))

    def _payload_bytes(self, codec: str, numel: int) -> int:
        """One direction's bytes: the codec's size, or for topk the largest frame the run's
        bounds admit in 4096-value chunks (compress.TopKConfig's chunk)."""
        if codec != av.TOPK:
            return _codecs.max_encoded_size(codec, numel)
        b, chunk = self.topk_bounds, 4096
        return sparse.encoded_size(numel, chunk, max(1, int(b.max_density * chunk)),
                                   b.max_value_bits, b.max_anchor_bits if b.max_anchor_bits >= 2
                                   else 0)

    def _count(self, partner: str, path: str, sent: int, received: int) -> None:
        st = self.estimates.of(partner)
        st.sent[path] += sent
        st.received[path] += received
        if self.stats is not None:
            self.stats.bytes_sent += sent
            self.stats.bytes_received += received

    # -- the trainer's side -----------------------------------------------------------

    async def exchange(self, r: int, snapshot: Any) -> Outcome:
        """Called by the training service at round r's boundary; never raises."""
        self._current = max(self._current, r)
        slot = self._round(r)
        slot.snapshot = snapshot
        slot.ready.set()
        # At most MAX_IN_FLIGHT exchanges with one partner at a time: rounds shorter than an
        # exchange (a tiny model on a fast CPU) would otherwise pile up streams to it, which
        # its guard refuses over its per-protocol budget. The rest of the round is local.
        numel = int(snapshot.numel())
        partners = [p for p in self.group(r) if self._in_flight[p] < MAX_IN_FLIGHT
                    and not self._kept_off_relay(p, numel)]
        self._remember(r, partners)
        if not partners:
            return Outcome(r, [])
        results: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            for p in partners:
                nursery.start_soon(self._with_partner, r, p, snapshot, numel, results)
        done = [p for p in partners if p in results]
        if done and self.after_round is not None and self._nursery is not None:
            self._nursery.start_soon(self.after_round, done)
        # a topk swap brings the partner's bundle (a list of frames; one outside DiLoCo)
        thetas = [t for p in done
                  for t in (results[p] if isinstance(results[p], list) else [results[p]])]
        return Outcome(r, thetas, partner=",".join(done) or None, peers=tuple(done))

    async def allreduce(self, r: int, snapshot: Any) -> Outcome:
        """DiLoCo's round r: the mean of every live worker's weights, from pairwise swaps
        one after the other (node/ml/optim/allreduce.py), as the training service's exchange.
        A step that fails fails the round (an empty outcome: a local step); never raises."""
        from node.ml.optim import allreduce

        workers = sorted({*self.members(), self.me})
        steps = self._plans[r] = allreduce.plan(self.me, workers)
        for old in [k for k in self._plans if k < r - 2]:
            del self._plans[old]
        if isinstance(snapshot, Compressed):
            return await self._allgather(r, snapshot, steps, len(workers))
        current, partners = snapshot, []
        for step in steps:
            outcome = await self.exchange(r * ALLREDUCE_STEPS + step.k, current)
            if not outcome.partner_thetas:
                log.info("round %d: all-reduce step %d with %s failed; local step", r, step.k,
                         step.partner)
                return Outcome(r, [])
            theirs = outcome.partner_thetas[0]
            current = (current * step.mine + theirs * step.theirs) / (step.mine + step.theirs)
            partners.append(step.partner)
        peers = tuple(dict.fromkeys(partners))
        return Outcome(r, [current] if steps else [], partner=",".join(peers) or None,
                       peers=peers)

    async def _allgather(self, r: int, own: Compressed, steps: list[Any],
                         workers: int) -> Outcome:
        """DiLoCo with topk frames: a sum of sparse frames is no frame, so the all-reduce's
        plan gathers every worker's frame instead. Where a step would average, the two
        sides' bundles (disjoint blocks of workers) are joined; where it hands over or takes
        back, one side's is kept. The outcome is every worker's frame, ours included, in
        the order of their bytes, so that every worker sums them in the same order and
        their φ stay bit-identical."""
        held, partners = list(own.frames), []
        for step in steps:
            outcome = await self.exchange(r * ALLREDUCE_STEPS + step.k,
                                          Compressed(tuple(held), own.size))
            if not outcome.partner_thetas:
                log.info("round %d: all-gather step %d with %s failed; local step", r, step.k,
                         step.partner)
                return Outcome(r, [])
            theirs = [sparse.encode(f) for f in outcome.partner_thetas]
            held = theirs if not step.mine else held + theirs if step.theirs else held
            partners.append(step.partner)
        if not steps:
            return Outcome(r, [])
        if len(held) != workers:  # a bundle short or long: not every worker's frame once
            log.info("round %d: all-gather ended with %d frames for %d workers; local step",
                     r, len(held), workers)
            return Outcome(r, [])
        try:
            frames = [sparse.decode(b, own.size, self.topk_bounds) for b in sorted(held)]
        except RemoteProtocolError as e:  # our own frame, or one the partner decoded
            log.info("round %d: all-gather produced a bad frame (%s); local step", r, e)
            return Outcome(r, [])
        peers = tuple(dict.fromkeys(partners))
        return Outcome(r, frames, partner=",".join(peers) or None, peers=peers)

    async def _with_partner(self, r: int, partner: str, snapshot: Any, numel: int,
                            results: dict[str, Any]) -> None:
        self._in_flight[partner] += 1
        try:
            await self._exchange_with(r, partner, snapshot, numel, results)
        finally:
            self._in_flight[partner] -= 1
            if not self._in_flight[partner]:
                del self._in_flight[partner]

    async def _exchange_with(self, r: int, partner: str, snapshot: Any, numel: int,
                             results: dict[str, Any]) -> None:
        limit = self.deadline(partner, numel)
        started = time.monotonic()
        try:
            with trio.fail_after(limit):
                if self.me < partner:
                    theta = await self._initiate(r, partner, snapshot)
                else:
                    slot = self._round(r)
                    done = slot.inbound_done.setdefault(partner, trio.Event())
                    await done.wait()
                    theta = slot.inbound.pop(partner, None)
            if theta is None:
                raise RemoteProtocolError("partner did not complete the exchange")
            results[partner] = theta
            self._progress.pop((r, partner), None)
            self.estimates.record(partner, 2 * numel * 4, time.monotonic() - started, ok=True)
        except trio.TooSlowError:
            self.estimates.record(partner, 0, 0, ok=False)
            self.estimates.timed_out(partner, limit, numel,
                                     self._progress.pop((r, partner), None))
            log.info("round %d: partner %s not done within %.1f s; local step", r, partner, limit)
        except Exception as e:
            self.estimates.record(partner, 0, 0, ok=False)
            log.info("round %d: exchange with %s failed (%s); local step", r, partner,
                     _reason(e))

    def _remember(self, r: int, partners: list[str]) -> None:
        self._recent[r] = list(partners)
        for old in [k for k in self._recent if k < r - 2]:  # bounded: a few rounds kept
            del self._recent[old]

    def partners_now(self) -> set[str]:
        """The last few rounds' partners: the redialer's max_peers trim spares them, so a
        partner dialed on demand keeps its connection through the exchange."""
        return {p for ps in self._recent.values() for p in ps}

    async def _initiate(self, r: int, partner: str, snapshot: Any) -> Any:
        if self.dial is not None:
            await self.dial(partner)  # a partner from the view we are not connected to
        stream = await self.transports.open_stream(ID.from_base58(partner), PROTOCOL_ID)
        try:
            # never a lane beside a data channel: it has no address to dial
            lanes = (av.LANE_TCP,) if self._lane_for(partner) and _path(stream) == "stream" \
                else ()
            ex = self._new_exchange("initiator", r, int(snapshot.numel()),
                                    self._offer(partner, int(snapshot.numel())), lanes)
            await stream.write(ex.initiate())
            event = await self._next(stream, ex)
            if isinstance(event, av.Rejected):
                raise RemoteProtocolError(f"rejected: {event.reason}")
            if not isinstance(event, av.Accepted):
                raise RemoteProtocolError(f"expected accept, got {type(event).__name__}")
            if isinstance(snapshot, Compressed) and event.codec != av.TOPK:
                self._no_topk(partner, event.codec)
                raise RemoteProtocolError(f"partner answered {event.codec}, not topk")
            if event.lane is None:
                return await self._swap(stream, ex, snapshot, partner, _path(stream), r)
            # Failed until it connects: a round deadline that cancels the dial must leave
            # the mark too, or every round would try the same unreachable lane again.
            self.lane_failed[partner] = time.monotonic()
            try:
                host = stream.get_remote_address()[0]
                lane = await connect_lane(host, event.lane.port, event.lane.key, timeout=2.0)
            except (OSError, trio.TooSlowError, TypeError) as e:
                raise RemoteProtocolError(f"bulk lane unreachable ({e!r}); the libp2p "
                                          f"stream for {LANE_RETRY_S:.0f} s") from e
            del self.lane_failed[partner]
            try:
                return await self._swap(lane, ex, snapshot, partner, "lane", r)
            finally:
                await close_quietly(lane)
        finally:
            await close_quietly(stream)

    def _new_exchange(self, role: av.Role, r: int | None, numel: int | None,
                      codecs: list[str], lanes: tuple[str, ...] = ()) -> av.Exchange:
        return av.Exchange(role, self.run_id, r, numel, codecs, lanes=lanes,
                           topk_bounds=self.topk_bounds if self.topk else None,
                           max_bundle=av.MAX_BUNDLE if self.all_reduce else 1)

    def _no_topk(self, partner: str, codec: str) -> None:
        """A partner of a topk run that answers in a dense codec: a local round (we hold
        only our frame), logged the first time."""
        if partner not in self._no_topk_logged:
            self._no_topk_logged.add(partner)
            log.warning("partner %s does not speak the topk codec (it chose %s): rounds with "
                        "it are local", partner, codec)

    def _offer(self, partner: str, numel: int) -> list[str]:
        if not self.auto_codec:
            return self.codecs
        st = self.partners.get(partner)
        return adapt.offer(adapt.AUTO, numel, path=self.transports.path_of(partner),
                           wire_rate=st.wire_bytes_per_s if st else None,
                           round_s=self.inner_steps * self.step_time())

    # -- the responder's side ---------------------------------------------------------

    async def handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            await self._respond(stream, peer)
        except Exception as e:  # said here, then raised for the guard's score
            log.info("exchange from %s failed: %s", peer, _reason(e))
            raise
        finally:
            await close_quietly(stream)

    async def _respond(self, stream: INetStream, peer: str) -> None:
        ex = self._new_exchange("responder", None, None, self.codecs)
        with trio.fail_after(10):
            offer = await self._next(stream, ex)
        if not isinstance(offer, av.OfferReceived):
            raise RemoteProtocolError(f"expected an offer, got {type(offer).__name__}")
        r = offer.round
        reason = None
        if r < self._current - 1:
            reason = f"round {r} is over here (at {self._current})"
        elif peer not in self.group(r):
            reason = f"not my partner in round {r}"
        elif (why := self._over_relay_limit(peer, offer.numel)) is not None:
            reason = why
        if reason:
            log.info("refused offer from %s: %s", peer, reason,
                     extra={"peer": peer, "reason": "offer"})
            await stream.write(ex.reject(reason))
            return
        slot = self._round(r)
        done = slot.inbound_done.setdefault(peer, trio.Event())
        try:
            # Our own trainer may reach the boundary a little after the partner did. If it
            # is later than that, the fault is ours: refuse politely (a handler error would
            # count against the partner's score in the guard).
            with trio.move_on_after(self.deadline(peer, offer.numel)):
                await slot.ready.wait()
            if not slot.ready.is_set():
                log.info("round %d: not at the boundary in time for %s; local step", r, peer)
                await stream.write(ex.reject(f"round {r} not reached here in time"))
                return
            if offer.numel != slot.snapshot.numel():
                log.info("refused offer from %s: %d values, our model has %d", peer,
                         offer.numel, slot.snapshot.numel(),
                         extra={"peer": peer, "reason": "offer size"})
                await stream.write(ex.reject(f"model has {slot.snapshot.numel()} values here, "
                                             f"not {offer.numel}"))
                return
            # not sparse.negotiate: its log promises a dense rule, and a topk run's rule for
            # a dense partner is a local round (module docstring), logged by _no_topk
            codec = av.TOPK if self.topk and av.TOPK in offer.codecs \
                else av.negotiate(offer.codecs, self.codecs)
            if (codec == av.TOPK) != isinstance(slot.snapshot, Compressed):
                self._no_topk(peer, codec)
                await stream.write(ex.reject("this run exchanges topk frames"))
                return
            if not (self.lanes and av.LANE_TCP in offer.lanes
                    and self.transports.lane_dialable()):
                await stream.write(ex.accept(codec))
                slot.inbound[peer] = await self._swap(stream, ex, slot.snapshot, peer,
                                                      _path(stream), r)
                return
            listener = LaneListener(self.lane_host)
            try:
                port = await listener.open()
                await stream.write(ex.accept(codec, av.Lane(av.LANE_TCP, port, listener.key)))
                lane = await listener.accept(timeout=5.0)
                try:
                    slot.inbound[peer] = await self._swap(lane, ex, slot.snapshot, peer, "lane",
                                                          r)
                finally:
                    await close_quietly(lane)
            finally:
                await listener.aclose()
        finally:
            done.set()

    # -- both sides -----------------------------------------------------------------

    async def _swap(self, stream: ByteStream, ex: av.Exchange, snapshot: Any, partner: str,
                    path: str, r: int) -> Any:
        """Send our vector while receiving theirs (full duplex), return theirs."""
        started = time.monotonic()
        chunks = ex.send_frames(snapshot.frames) if isinstance(snapshot, Compressed) \
            else ex.send_vector(snapshot)
        sent = sum(len(memoryview(c).cast("B")) for c in chunks)
        received = 0
        # What arrived so far, for an exchange that runs out of its deadline (timed_out)
        progress = Progress(started, sent)
        self._progress[(r, partner)] = progress
        while len(self._progress) > 4 * MAX_IN_FLIGHT * max(1, self.group_size):
            del self._progress[next(iter(self._progress))]  # bounded: oldest first

        async def send() -> None:
            await write_chunks(stream, chunks)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while True:
                event = await self._next(stream, ex)
                if isinstance(event, av.PeerDone):
                    break
                if isinstance(event, av.ChunkReceived):
                    received += event.nbytes
                    progress.received, progress.last = received, time.monotonic()
        self._count(partner, path, sent, received)
        st = self.partners[partner]
        seconds = time.monotonic() - started
        if seconds > 0:
            rate = (sent + received) / seconds
            st.wire_bytes_per_s = rate if st.wire_bytes_per_s is None \
                else 0.7 * st.wire_bytes_per_s + 0.3 * rate
        st.last_codec = ex.codec
        return ex.received_frames() if ex.codec == av.TOPK else ex.received_vector()

    async def _next(self, stream: ByteStream, ex: av.Exchange) -> Any:
        return await pump(stream, ex.next_event, ex.receive_data, into=ex)


def _reason(e: BaseException) -> str:
    """What failed, for the log: the errors inside a nursery's exception group."""
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_reason(x) for x in e.exceptions)
    return str(e) or type(e).__name__


def _path(stream: Any) -> str:
    """How a swap's bytes are counted: "stream" (libp2p) or the stream's own `path`
    ("webrtc": a data channel)."""
    return getattr(stream, "path", "stream")

