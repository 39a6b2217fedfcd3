"""What each message weighs on the wire, from the real encoders, measured once per process.

The simulator counts messages; their bytes come from encoding one real specimen of each
kind with the code the node runs: a heartbeat (protocols/heartbeat.py), a run-document
announce delta and anti-entropy summary (protocols/rundoc.py, really signed), a checkpoint
manifest (protocols/checkpoint.py), gossipsub's RPC envelope and IHAVE control entries
(py-libp2p's rpc_pb2) and Kademlia's messages (py-libp2p's kademlia_pb2). What is not
encoded is the transport: each message pays FRAME_OVERHEAD bytes of Noise (2-byte length
+ 16-byte tag) and Yamux (12-byte header) framing, as one write.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import msgpack

from node.run.rundoc_sync import own_announce

FRAME_OVERHEAD = 2 + 16 + 12  # Noise length + AEAD tag, Yamux frame header
RUN_ID = "Qm" + "x" * 44  # a run id is a base58 sha2-256 multihash: 46 characters
SEED = bytes(range(32))  # a fixed key: the sizes never depend on randomness


def _varint_len(n: int) -> int:
    return max(1, math.ceil(n.bit_length() / 7))


@dataclass(frozen=True)
class Sizes:
    """Bytes on the wire of each message kind (framing included)."""

    heartbeat: int  # one gossiped heartbeat, RPC + framing
    announce: int  # one run-document announce delta (own 2 entries), RPC + framing
    entry: int  # one run-document entry inside a delta (msgpack row)
    entries_per_peer: int  # entries each live peer keeps in the document
    summary: int  # anti-entropy summary when every bucket is non-empty
    ihave_per_id: int  # one message id inside an IHAVE control message
    ihave_base: int  # an IHAVE RPC with no ids, framing included
    dht_request: int  # FIND_NODE / GET_PROVIDERS request
    dht_reply: int  # a reply carrying k = 20 closer peers
    add_provider: int  # ADD_PROVIDER with our record
    manifest_per_chunk: int  # checkpoint manifest bytes per 4 MiB chunk
    avg_fixed: int  # one side of an averaging exchange: offer or accept, and done
    avg_per_frame: int  # framing of one tensor frame (4 MiB of fp32) beyond its values
    avg_chunk_bytes: int  # fp32 bytes per tensor frame
    # the same three before issue 30: a key per field (5 entries announced, 6 kept)
    announce_fields: int = 0
    entry_fields: int = 0
    entries_per_peer_fields: int = 0


def avg_session_bytes(s: Sizes, model_bytes: float) -> tuple[float, int]:
    """(bytes, messages) one side sends in one exchange of a `model_bytes` fp32 vector."""
    frames = max(1, math.ceil(model_bytes / s.avg_chunk_bytes))
    return model_bytes + s.avg_fixed + frames * s.avg_per_frame, frames + 2


def gossip_rpc(data_len: int, topic: str) -> int:
    """Bytes of a gossipsub RPC carrying one signed message of `data_len` bytes."""
    from libp2p.pubsub.pb import rpc_pb2

    msg = rpc_pb2.Message(from_id=bytes(38), data=bytes(data_len), seqno=bytes(8),
                          topicIDs=[topic], signature=bytes(64))
    rpc = rpc_pb2.RPC(publish=[msg])
    n = rpc.ByteSize()
    return n + _varint_len(n) + FRAME_OVERHEAD


@functools.cache
def measure() -> Sizes:
    """Encode one specimen of each kind (about 20 ms; cached for the process)."""
    from libp2p.kad_dht.pb import kademlia_pb2 as kpb
    from libp2p.pubsub.pb import rpc_pb2

    from protocols import checkpoint, heartbeat, rundoc
    from protocols.keys import Signer

    signer = Signer(SEED)
    me = signer.peer_id
    addrs = (f"/ip4/203.0.113.7/tcp/4001/p2p/{me}", f"/ip4/10.0.0.7/tcp/4001/p2p/{me}")
    stats = {"uptime": 1234.5, "step": 4200, "loss": 2.3456, "val": 2.4567, "stage": 0,
             "gnorm": 0.8123, "trained": 4180, "t": 1795000000.1}
    beat = heartbeat.Heartbeat(me, 4200, addrs, "node", "cuda", stats, 1795000000000)
    hb_bytes = len(beat.encode())
    hb_topic = heartbeat.topic(RUN_ID)

    now = 1_795_000_000_000
    info = {"addrs": list(addrs), "role": "node", "device": "cuda", "stats": stats}

    def document(own: dict) -> tuple[int, int, int]:
        """(announce delta bytes, bytes per entry, entries) of a peer announcing `own`
        and holding one checkpoint."""
        doc = rundoc.RunDocument(RUN_ID, signer, [me])
        for key, value in own.items():
            doc.set(key, value, now)
        doc.set(rundoc.ckpt_key(me, "Qm" + "c" * 44),
                {"hash": "Qm" + "c" * 44, "step": 4200, "size": 100 << 20}, now)
        ann = doc.encode_delta([e for e in doc.entries() if e.key.split("/")[2] != "ckpt"])
        full = doc.encode_delta(list(doc.entries()))
        return len(ann), math.ceil((len(full) - len(doc.encode_delta([]))) / len(doc)), len(doc)

    # the node's own announce (RunDocSync: one `info` entry and `last_seen`), and the one
    # before issue 30 (a key per field)
    announce, entry, per_peer = document(own_announce(me, info, now))
    announce_f, entry_f, per_peer_f = document(
        {f"peer/{me}/{k}": v for k, v in {**info, "last_seen": now}.items()})
    # A summary lists (u16 bucket, u64 hash) per non-empty bucket: all of them once the
    # document holds a few thousand keys.
    summary = len(msgpack.packb([rundoc.VERSION, RUN_ID, bytes(10 * rundoc.BUCKETS)]))

    ihave_none = rpc_pb2.RPC(control=rpc_pb2.ControlMessage(
        ihave=[rpc_pb2.ControlIHave(topicID=hb_topic, messageIDs=[])]))
    ihave_100 = rpc_pb2.RPC(control=rpc_pb2.ControlMessage(
        ihave=[rpc_pb2.ControlIHave(topicID=hb_topic, messageIDs=[bytes(46)] * 100)]))
    per_id = math.ceil((ihave_100.ByteSize() - ihave_none.ByteSize()) / 100)

    peer = kpb.Message.Peer(id=bytes(38), addrs=[bytes(10)] * 2)
    req = kpb.Message(type=kpb.Message.MessageType.GET_PROVIDERS, key=bytes(40))
    reply = kpb.Message(type=kpb.Message.MessageType.FIND_NODE, key=bytes(40),
                        closerPeers=[peer] * 20)
    add = kpb.Message(type=kpb.Message.MessageType.ADD_PROVIDER, key=bytes(40),
                      providerPeers=[peer])

    m = checkpoint.CheckpointManifest(RUN_ID, 4200, now, 400 << 20, checkpoint.CHUNK_BYTES,
                                      tuple("0" * 64 for _ in range(100)), {"peer": me})
    per_chunk = math.ceil(len(m.encode()) / 100)

    fixed, per_frame, chunk = _averaging()

    def framed(n: int) -> int:
        return n + _varint_len(n) + FRAME_OVERHEAD

    return Sizes(
        heartbeat=gossip_rpc(hb_bytes, hb_topic),
        announce=gossip_rpc(announce, f"/peertrain/{RUN_ID}/meta/1"),
        entry=entry,
        entries_per_peer=per_peer,
        announce_fields=gossip_rpc(announce_f, f"/peertrain/{RUN_ID}/meta/1"),
        entry_fields=entry_f,
        entries_per_peer_fields=per_peer_f,
        summary=framed(summary + 16),  # + the meta.summary envelope
        ihave_per_id=per_id,
        ihave_base=framed(ihave_none.ByteSize()),
        dht_request=framed(req.ByteSize()),
        dht_reply=framed(reply.ByteSize()),
        add_provider=framed(add.ByteSize()),
        manifest_per_chunk=per_chunk,
        avg_fixed=fixed,
        avg_per_frame=per_frame,
        avg_chunk_bytes=chunk,
    )


def _averaging() -> tuple[int, int, int]:
    """Run one real /peertrain/avg/1.0.0 exchange (protocols/averaging.py) of 3 frames and
    split what each side wrote into its fixed part and its per-frame framing."""
    import torch

    from protocols import averaging as av

    chunk = 1 << 10
    numel = 3 * chunk
    a = av.Exchange("initiator", RUN_ID, 7, numel, ["fp32"], chunk_elems=chunk)
    b = av.Exchange("responder", RUN_ID, None, None, ["fp32"])
    offer = a.initiate()
    b.receive_data(offer)
    b.next_event()
    accept = b.accept("fp32")
    a.receive_data(accept)
    a.next_event()
    sent = a.send_vector(torch.zeros(numel))
    total = sum(len(memoryview(x).cast("B")) for x in sent)
    done = len(sent[-1])
    per_frame = (total - done - 4 * numel) // 3 + FRAME_OVERHEAD
    fixed = max(len(offer), len(accept)) + done + 2 * FRAME_OVERHEAD
    return fixed, per_frame, 4 * av.DEFAULT_CHUNK_ELEMS
