"""The node's status as Prometheus metric families.

One custom collector reads the dict `node status --json` returns (the daemon's `status()`:
identity, phase, substrate counters and every service's `statistics()`) and yields metric
families from it. Services keep plain counters and never import prometheus_client; this
is the only place that names a metric (docs/operator.md lists them all). Reading a status
dict rather than instrumenting code also means a metric and `node status` never disagree.

Names follow Prometheus's conventions: a `peertrain_` prefix, base units in the name
(`_seconds`, `_bytes`), counters end in `_total` (the exposition adds it), and a label only
where its values are few (peers of a run, operations, reasons, phases).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

P = "peertrain_"


class StatusCollector(Collector):
    """Yields the families of one status snapshot; `extra()` adds what the metrics
    service itself measures (checkpoint bytes held, peers by path, page requests)."""

    def __init__(self, status: Callable[[], dict[str, Any]],
                 extra: Callable[[], dict[str, Any]] = dict) -> None:
        self.status = status
        self.extra = extra

    def collect(self) -> Iterator[Metric]:
        st = self.status()
        yield from build_families()
        yield from node_families(st)
        yield from training_families(st.get("training") or {})
        yield from pipeline_families(st.get("pipeline") or {})
        yield from averaging_families(st.get("averaging") or {}, current_peers(st))
        yield from dht_families((st.get("p2p") or {}).get("dht_operations") or {})
        yield from guard_families(st)
        yield from path_families(st.get("peer_paths") or {})
        x = self.extra()
        by_kind = (st.get("peer_paths") or {}).get("by_kind")
        if by_kind:  # the path service's kinds (punched, upnp, ...) over the substrate's two
            x = {**x, "peers_by_path": by_kind}
        yield from extra_families(x)


def _gauge(name: str, doc: str, value: float | None, **labels: str) -> Iterator[Metric]:
    if value is None:
        return
    g = GaugeMetricFamily(P + name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), float(value))
    yield g


def _counter(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is None:
        return
    yield CounterMetricFamily(P + name, doc, value=float(value))


def _labelled(cls: type, name: str, doc: str, label: str,
              values: dict[str, Any]) -> Iterator[Metric]:
    m = cls(P + name, doc, labels=[label])
    for key, value in sorted(values.items()):
        m.add_metric([str(key)], float(value))
    yield m


def _histogram(name: str, doc: str, labels: list[str],
               series: list[tuple[list[str], dict[str, Any]]]) -> Iterator[Metric]:
    """series: (label values, a p2p.timing.Timings snapshot) per labelled histogram."""
    h = HistogramMetricFamily(P + name, doc, labels=labels)
    for values, snap in series:
        buckets = [(le if le == "+Inf" else repr(float(le)), float(n))
                   for le, n in snap["buckets"]]
        h.add_metric(values, buckets, sum_value=float(snap["sum"]))
    yield h


MAX_PEER_LABELS = 64  # per-peer series at most, the most recently active first


def build_families() -> Iterator[Metric]:
    """`peertrain_build_info{version, python, libp2p}` 1: which build a series came from."""
    yield from _gauge("build_info", "1, labelled with the versions this node runs.", 1,
                      **_versions())


def _versions() -> dict[str, str]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for label, dist in (("version", "peertrain"), ("libp2p", "libp2p")):
        try:
            out[label] = version(dist)
        except PackageNotFoundError:
            out[label] = "unknown"
    out["python"] = platform.python_version()
    return out


def current_peers(st: dict[str, Any]) -> set[str] | None:
    """The peers a per-peer series may name: members heard within the heartbeat TTL and
    peers connected now. A departed peer's series end (Prometheus marks them stale);
    before, they stayed for the node's life, one set of labels per peer ever seen."""
    membership = st.get("membership") or {}
    paths = (st.get("peer_paths") or {}).get("peers")
    if "peers" not in membership and paths is None:
        return None  # nothing says who is here: keep the newest MAX_PEER_LABELS
    peers = {str(e.get("peer_id")) for e in membership.get("peers", []) if isinstance(e, dict)}
    return peers | set(paths or {})


def node_families(st: dict[str, Any]) -> Iterator[Metric]:
    info = InfoMetricFamily(P + "node", "Who this node is and what it runs.")
    info.add_metric([], {k: str(st.get(k) or "") for k in
                         ("peer_id", "role", "run", "run_name", "device")})
    yield info
    yield from _labelled(GaugeMetricFamily, "node_phase",
                         "1 for the phase the node is in, 0 for the others it went through.",
                         "phase", {p: p == st.get("phase") for p in st.get("phase_times", {})})
    yield from _labelled(GaugeMetricFamily, "node_phase_started_seconds",
                         "When each phase began, in seconds after the node started (the "
                         "join's phases; 'first step' ends a join).", "phase",
                         st.get("phase_times", {}))
    yield from _gauge("node_uptime_seconds", "Seconds since the node started.",
                      st.get("uptime_s"))
    p2p = st.get("p2p") or {}
    yield from _gauge("connected_peers", "Peers with an open libp2p connection.",
                      p2p.get("connections"))
    yield from _gauge("dht_routing_table_peers", "Peers in the DHT routing table.",
                      p2p.get("dht_routing_table"))
    yield from _counter("host_restarts", "Times the libp2p host died and was restarted.",
                        p2p.get("host_restarts"))
    inbound = p2p.get("inbound") or {}
    if inbound:
        yield from _gauge("inbound_slots_in_use", "Inbound connections holding one of "
                          "py-libp2p's inbound slots (p2p/slots.py).", inbound.get("in_use"))
        yield from _labelled(CounterMetricFamily, "inbound_connections_refused",
                             "Inbound connections refused, by reason (slots_full, "
                             "conns_per_peer).", "reason",
                             {"slots_full": 0, "conns_per_peer": 0, **inbound["refused"]})
    gossip = p2p.get("gossip") or {}
    yield from _labelled(CounterMetricFamily, "gossip_messages",
                         "Gossip messages we published, by outcome (dropped: the paced "
                         "queue was full).", "outcome", gossip)
    membership = st.get("membership") or {}
    if "peers" in membership:
        yield from _gauge("run_peers_live", "Members of the run heard from within the "
                          "heartbeat TTL.", len(membership["peers"]))
        yield from _gauge("run_members", "Members of the run in the run document.",
                          len(membership.get("members", [])))
        yield from _counter("heartbeats_sent", "Heartbeats this node published.",
                            membership.get("heartbeats_sent"))
        yield from _gauge("heartbeat_interval_seconds", "Seconds between this node's "
                          "heartbeats: max(heartbeat_s, live peers / target rate).",
                          membership.get("heartbeat_interval_s"))
        yield from _gauge("heartbeats_inbound_per_second", "Heartbeats received a second "
                          "(mean over 10 s), taken or dropped.",
                          membership.get("inbound_heartbeats_per_s"))
        yield from _counter("heartbeats_throttled", "Heartbeats dropped over the inbound "
                            "bound (a peer beating faster than the policy, or all of them).",
                            membership.get("throttled_heartbeats"))
    ckpt = st.get("checkpoints") or {}
    yield from _counter("checkpoints_saved", "Checkpoints this node saved.", ckpt.get("saved"))
    yield from _counter("checkpoint_save_failures", "Checkpoint saves that failed.",
                        ckpt.get("failed"))
    download = ckpt.get("download") or {}
    yield from _gauge("checkpoint_download_chunks", "Chunks of the joining download held.",
                      download.get("done"))
    yield from _gauge("checkpoint_download_chunks_expected", "Chunks the joining download "
                      "needs.", download.get("total"))
    server = st.get("checkpoint_server") or {}
    if server:
        yield from _labelled(CounterMetricFamily, "checkpoint_requests_served",
                             "Checkpoint manifest and chunk requests answered, by result.",
                             "result", {"served": server.get("served", 0),
                                        "not_held": server.get("not_held", 0)})


def training_families(t: dict[str, Any]) -> Iterator[Metric]:
    if not t:
        return
    yield from _gauge("training_step", "Inner steps this node's model has taken.", t.get("step"))
    yield from _gauge("training_round", "The outer (averaging) round.", t.get("round"))
    yield from _gauge("training_loss", "The last inner step's training loss.", t.get("loss"))
    yield from _gauge("validation_loss", "The last evaluation's validation loss.",
                      t.get("val_loss"))
    yield from _gauge("training_learning_rate", "The inner optimizer's learning rate.",
                      t.get("lr"))
    yield from _gauge("model_parameters", "Parameters of the model this node trains.",
                      t.get("params"))
    yield from _counter("training_compute_seconds", "Seconds the trainer spent computing.",
                        t.get("compute_s"))
    yield from _gauge("training_compute_ratio", "Share of wall time spent computing.",
                      t.get("compute_fraction"))
    yield from _labelled(CounterMetricFamily, "training_rounds",
                         "Outer rounds, by outcome: averaged with partners or local.",
                         "outcome", {"averaged": t.get("rounds_averaged", 0),
                                     "local": t.get("rounds_local", 0)})


#: A pipeline host's phases, without their details (node/pipe/stall.py phase_class).
PIPELINE_PHASES = ("choosing a stage", "waiting for stages", "recovering", "training",
                   "stalled")


def pipeline_families(pipe: dict[str, Any]) -> Iterator[Metric]:
    """A pipeline host's phase (`stalled` once its steps stop completing), how long it has
    been stalled, and how old the loss it shows is."""
    phase = pipe.get("phase")
    if not isinstance(phase, str):
        return
    from node.pipe.stall import phase_class

    now = phase_class(phase)
    yield from _labelled(GaugeMetricFamily, "pipeline_phase",
                         "1 for the pipeline phase this host is in (stalled: no step trained "
                         "a micro-batch for two deadlines), 0 for the others.", "phase",
                         {p: p == now for p in {*PIPELINE_PHASES, now}})
    stall = pipe.get("stall") or {}
    yield from _gauge("pipeline_stalled_seconds", "Seconds since this host's last step "
                      "that trained a micro-batch, while stalled; 0 while steps complete.",
                      stall.get("since_s", 0.0))
    yield from _gauge("pipeline_loss_age_seconds", "Seconds since the last stage computed "
                      "the loss it reports (last-stage hosts only).",
                      (pipe.get("training") or {}).get("loss_age_s"))


def averaging_families(a: dict[str, Any], current: set[str] | None = None
                       ) -> Iterator[Metric]:
    """Exchange metrics; per-partner series only for `current` peers (current_peers),
    at most MAX_PEER_LABELS of them."""
    if not a:
        return
    if "exchange_seconds" in a:
        yield from _histogram("exchange_seconds", "Weight exchanges that succeeded, from "
                              "the round boundary to the partner's vector received.", [],
                              [([], a["exchange_seconds"])])
    partners = {peer: p for peer, p in (a.get("partners") or {}).items()
                if current is None or peer in current}
    if len(partners) > MAX_PEER_LABELS:
        newest = sorted(partners, key=lambda peer: partners[peer].get("last_exchange_unix")
                        or 0, reverse=True)[:MAX_PEER_LABELS]
        partners = {peer: partners[peer] for peer in newest}
    for direction in ("sent", "received"):
        m = CounterMetricFamily(P + f"exchange_{direction}_bytes",
                                f"Tensor bytes {direction} in weight exchanges, by partner "
                                "and path (lane: the bulk TCP lane; stream: libp2p).",
                                labels=["peer", "path"])
        for peer, p in sorted(partners.items()):
            for path, n in sorted((p.get(f"bytes_{direction}") or {}).items()):
                m.add_metric([peer, path], float(n))
        yield m
    for key, name, doc in (("exchanges", "exchanges", "Weight exchanges that succeeded."),
                           ("failures", "exchange_failures",
                            "Weight exchanges that failed (a local step instead).")):
        yield from _labelled(CounterMetricFamily, name, doc + " By partner.", "peer",
                             {peer: p.get(key, 0) for peer, p in partners.items()})
    # Measured only: an unmeasured partner's rate is the planning prior (50 MB/s), which
    # was exported as if it had been seen.
    yield from _labelled(GaugeMetricFamily, "exchange_throughput_bytes_per_second",
                         "Each partner's measured exchange throughput (EWMA).", "peer",
                         {peer: p.get("mb_per_s", 0) * 1e6 for peer, p in partners.items()
                          if p.get("exchanges")})


def dht_families(d: dict[str, Any]) -> Iterator[Metric]:
    if not d:
        return
    yield from _histogram("dht_operation_seconds", "DHT operations by kind (bootstrap, "
                          "put, get, provide, find_providers).", ["operation"],
                          [([op], snap) for op, snap in sorted(d.items())])
    yield from _labelled(CounterMetricFamily, "dht_operation_failures",
                         "DHT operations that raised (a put without an answer).", "operation",
                         {op: snap.get("failures", 0) for op, snap in d.items()})


def guard_families(st: dict[str, Any]) -> Iterator[Metric]:
    """Every message or stream refused, by reason: the gate's budget refusals, scored
    misbehaviour and missed deadlines, and the gossip rejected by heartbeats and the run
    document."""
    guard = st.get("guard") or {}
    reasons: dict[str, float] = {}
    for group in ("refused", "misbehaviour", "deadline_misses"):
        for reason, n in (guard.get(group) or {}).items():
            key = f"{group}:{reason}" if group != "refused" else str(reason)
            reasons[key] = reasons.get(key, 0) + n
    hb = (st.get("membership") or {}).get("rejected_heartbeats")
    if hb:
        reasons["heartbeat"] = hb
    doc = (st.get("run_document") or {}).get("rejected")
    if doc:
        reasons["run_document"] = doc
    yield from _labelled(CounterMetricFamily, "messages_rejected",
                         "Inbound streams, connections and messages refused, by reason.",
                         "reason", reasons)
    if guard:
        yield from _gauge("peers_banned", "Peers banned now.", len(guard.get("bans") or {}))
        yield from _counter("bans", "Bans imposed since start.", guard.get("bans_total"))
        yield from _gauge("inbound_streams", "Inbound streams open now.",
                          guard.get("inbound_streams"))
        yield from _labelled(CounterMetricFamily, "log_lines_suppressed",
                             "Log lines about a misbehaving peer left out (flood filter).",
                             "reason", (guard.get("logs") or {}).get("suppressed") or {})
    yield from _counter("handler_errors", "Stream handlers that raised (the stream was "
                        "reset, the host lives on).", (st.get("p2p") or {}).get("handler_errors"))


def path_families(paths: dict[str, Any]) -> Iterator[Metric]:
    peers = paths.get("peers") or {}
    if not peers:
        return
    m = GaugeMetricFamily(P + "peer_rtt_seconds", "Smoothed libp2p ping round trip "
                          "to each connected peer, with its path.", labels=["peer", "path"])
    for peer, p in sorted(peers.items()):
        if p.get("rtt_ms") is not None:
            path = "relayed" if str(p.get("path", "")).startswith("relayed") else p.get("path")
            m.add_metric([peer, str(path)], float(p["rtt_ms"]) / 1000)
    yield m


def extra_families(x: dict[str, Any]) -> Iterator[Metric]:
    if "peers_by_path" in x:
        yield from _labelled(GaugeMetricFamily, "peers", "Connected peers by path (direct, "
                             "upnp, punched, webrtc; relayed through a circuit relay).",
                             "path", x["peers_by_path"])
    yield from _gauge("checkpoint_held_bytes", "Bytes of this run's checkpoints on disk.",
                      x.get("checkpoint_bytes"))
    yield from _gauge("checkpoints_held", "This run's checkpoints on disk.",
                      x.get("checkpoints_held"))
    if "http_requests" in x:
        yield from _labelled(CounterMetricFamily, "http_requests",
                             "Requests to this metrics and status port, by response code.",
                             "code", x["http_requests"])
