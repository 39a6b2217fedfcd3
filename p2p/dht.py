"""A Kademlia DHT wrapper around py-libp2p's KadDHT, with peertrain's own protocol id.

What the wrapper adds (each item is a measured quirk of py-libp2p 0.8.1, notes/libp2p.md §4):

* Protocol id `/peertrain/kad/1.0.0` instead of the hard-wired public `/ipfs/kad/1.0.0`, so
  a peertrain node never joins, nor answers, the public IPFS DHT. KadDHT ignores its
  `protocol_prefix` argument; the constant is bound by name in several modules, so we
  rebind it in each of them at import.
* Namespaced keys (`/<namespace>/<rest>`) checked by validators supplied by the caller;
  with strict validation on, a key in a namespace nobody registered is refused.
* `find_providers` deduplicates by peer id and always asks the network, even when it holds
  local records (KadDHT stops at the first local record and returns duplicates).
* `provide` is remembered and re-announced periodically: KadDHT's provide is
  fire-and-forget, and provider records expire.
* A deadline on every inbound DHT stream (`STREAM_DEADLINE_S`, applied by the host's
  gate, p2p/gate.py): KadDHT's handler reads messages in a loop with no timeout, so a
  half-sent message or an idle stream was held forever, and twelve of them filled its
  global inbound limiter, refusing every honest peer's query.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import libp2p.kad_dht.common as _common
import libp2p.kad_dht.kad_dht as _kad
import libp2p.kad_dht.peer_routing as _routing
import libp2p.kad_dht.provider_store as _providers
import libp2p.kad_dht.value_store as _values
import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import MessageTooLarge
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.records.utils import verify_record
from libp2p.records.validator import NamespacedValidator, Validator
from libp2p.tools.anyio_service import background_trio_service

from p2p.blame import blame
from p2p.timing import Timings

log = logging.getLogger(__name__)

DHT_PROTOCOL = TProtocol("/peertrain/kad/1.0.0")
for _module in (_common, _kad, _routing, _providers, _values):
    _module.PROTOCOL_ID = DHT_PROTOCOL  # type: ignore[attr-defined]

# How long one inbound DHT stream may live. py-libp2p's clients open a stream per request
# and close it after the answer (milliseconds on a LAN); 15 s leaves a loaded node's slow
# answer room, and is above a query's own 10 s timeout.
STREAM_DEADLINE_S = 15.0

# The DHT logs a WARNING for every cleanly finished request (EOF is read as an error).
logging.getLogger("libp2p.kad_dht").setLevel(logging.ERROR)

# The DHT whose inbound stream this task is handling (its validator screens what is read).
_serving: contextvars.ContextVar[DHT | None] = contextvars.ContextVar("dht_serving",
                                                                    default=None)
_read_limited = _kad.read_varint_prefixed_bytes_limited


async def _screened_read(stream: Any, max_length: int) -> bytes:
    """KadDHT's inbound read (its only caller is the inbound handler), with the sender
    blamed for what KadDHT would drop without a word to the gate."""
    try:
        data = await _read_limited(stream, max_length)
    except (MessageTooLarge, ParseError) as e:
        blame("invalid", f"DHT message refused: {e!r}")
        raise
    dht = _serving.get()
    if dht is not None and (why := dht.screen(data)) is not None:
        blame("invalid", why)
    return data


_kad.read_varint_prefixed_bytes_limited = _screened_read  # type: ignore[assignment]


class DHT:
    """The node's view of the DHT. Create it before the host connects to anyone."""

    def __init__(
        self,
        host: IHost,
        validators: dict[str, Validator] | None = None,
        *,
        reprovide_interval: float = 60.0,
        query_timeout: float = 10.0,
    ) -> None:
        self.host = host
        self.protocol = DHT_PROTOCOL
        self.reprovide_interval = reprovide_interval
        self.query_timeout = query_timeout
        self.kad = KadDHT(
            host,
            DHTMode.SERVER,
            validator=NamespacedValidator(dict(validators or {}), strict_validation=True),
            validator_changed=True,
            strict_validation=True,
        )
        self._provided: set[str] = set()
        self.junk = 0  # inbound messages screened out (scored on their sender)
        inner = self.kad._do_handle_stream

        async def serving(stream: Any) -> None:
            token = _serving.set(self)
            try:
                await inner(stream)
            finally:
                _serving.reset(token)

        self.kad._do_handle_stream = serving  # type: ignore[method-assign]
        # op -> its durations and how many ended without an answer (timeout or error):
        # the metrics service exports them (peertrain_dht_operation_seconds, ..._failures).
        self.timings: dict[str, Timings] = {}
        self.failures: dict[str, int] = {}

    def screen(self, data: bytes) -> str | None:
        """Why KadDHT will drop this inbound message (None: nothing to hold against its
        sender). Only what is the sender's fault: an older record than ours is no lie."""
        msg = Message()
        try:
            msg.ParseFromString(data)
        except Exception:
            why: str | None = "DHT message: not a protobuf"
        else:
            why = None
            if msg.type == Message.MessageType.PUT_VALUE and msg.HasField("record"):
                why = self._screen_record(msg)
        if why is not None:
            self.junk += 1
        return why

    def _screen_record(self, msg: Message) -> str | None:
        record = msg.record
        if not record.key or msg.key != record.key:
            return "DHT PUT_VALUE: no key, or the record's key is not the message's"
        if len(record.SerializeToString()) > _common.MAX_RECORD_SIZE:
            return f"DHT PUT_VALUE: a record over {_common.MAX_RECORD_SIZE} bytes"
        try:
            assert self.kad.validator is not None  # the substrate always gives one
            self.kad.validator.validate(record.key.decode("utf-8"), record.value)
        except Exception as e:
            return f"DHT PUT_VALUE: refused by the validator: {e}"
        if record.signature and record.author and not verify_record(
                record.signature, record.author, record.key, record.value):
            return "DHT PUT_VALUE: a bad signature"
        return None

    @contextmanager
    def _timed(self, op: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        except Exception:  # an outer cancellation is no failure of the DHT
            self.failures[op] = self.failures.get(op, 0) + 1
            raise
        finally:
            self.timings.setdefault(op, Timings()).observe(time.monotonic() - started)

    def statistics(self) -> dict[str, Any]:
        """Per operation (bootstrap, put, get, provide, find_providers): durations and
        failures. A lookup that ran out its deadline counts as a duration, not a failure
        (find_providers returns what it found by then)."""
        return {op: {**t.snapshot(), "failures": self.failures.get(op, 0)}
                for op, t in sorted(self.timings.items())}

    @asynccontextmanager
    async def running(self) -> AsyncIterator[DHT]:
        async with background_trio_service(self.kad), trio.open_nursery() as nursery:
            nursery.start_soon(self._reprovide_loop)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()

    async def add_peer(self, peer: ID) -> None:
        # skip_server_mode_check: identify may not have finished yet (notes §4, add_peer).
        await self.kad.add_peer(peer, skip_server_mode_check=True)

    async def bootstrap(self) -> None:
        """Self-lookup through the peers we know: fills the routing table."""
        with self._timed("bootstrap"), trio.move_on_after(self.query_timeout):
            await self.kad.refresh_routing_table()

    def routing_table_size(self) -> int:
        return self.kad.get_routing_table_size()

    async def put(self, key: str, value: bytes) -> None:
        """Store a record under a namespaced key (`/ns/rest`); validators run locally first."""
        with self._timed("put"), trio.fail_after(self.query_timeout):
            await self.kad.put_value(key, value)

    async def get(self, key: str) -> bytes | None:
        with self._timed("get"), trio.move_on_after(self.query_timeout):
            return await self.kad.get_value(key)
        return None

    async def provide(self, key: str) -> None:
        """Announce that we provide `key`, and keep announcing it every reprovide_interval."""
        self._provided.add(key)
        with self._timed("provide"), trio.move_on_after(self.query_timeout):
            await self.kad.provide(key)

    def stop_providing(self, key: str) -> None:
        self._provided.discard(key)

    def providing(self, key: str) -> bool:
        """Whether `key` is re-provided every reprovide_interval."""
        return key in self._provided

    async def find_providers(self, key: str, count: int = 20,
                             timeout: float | None = None) -> list[PeerInfo]:
        """Providers of `key`, local and from the network, one entry per peer: what was found
        within `timeout` (default query_timeout; a dead peer in the routing table can hold
        a lookup that long)."""
        encoded = _kad._encode_key(key)
        found: dict[ID, PeerInfo] = {}

        def add(infos: list[PeerInfo]) -> None:
            for info in infos:
                known = found.get(info.peer_id)
                if known is None:
                    found[info.peer_id] = PeerInfo(info.peer_id, list(info.addrs))
                else:
                    known.addrs.extend(a for a in info.addrs if a not in known.addrs)

        add(self.kad.provider_store.get_providers(encoded))
        deadline = self.query_timeout if timeout is None else timeout
        with self._timed("find_providers"), trio.move_on_after(deadline):
            peers = await self.kad.peer_routing.find_closest_peers_network(encoded)
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    if peer != self.host.get_id():
                        nursery.start_soon(self._ask_providers, peer, encoded, add)
        return list(found.values())[:count]

    async def _ask_providers(self, peer: ID, key: bytes, add) -> None:
        try:
            store = self.kad.provider_store
            providers, _closer = await store._get_providers_from_peer_with_closers(peer, key)
        except Exception as e:  # one silent peer must not fail the whole lookup
            log.debug("GET_PROVIDERS to %s failed: %r", peer, e)
            return
        add(providers)

    async def _reprovide_loop(self) -> None:
        while True:
            await trio.sleep(self.reprovide_interval)
            for key in list(self._provided):
                with trio.move_on_after(self.query_timeout):
                    try:
                        await self.kad.provide(key)
                    except Exception as e:
                        log.info("re-provide of %s failed: %r", key, e)
