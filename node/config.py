"""What a node is told to do: one dataclass, filled from CLI flags (cli/) or by the testnet."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from p2p.budget import BudgetLimits
from p2p.scores import ScoreSettings


def default_state_dir() -> Path:
    return Path(platformdirs.user_data_dir("peertrain", appauthor=False))


@dataclass
class NodeConfig:
    state_dir: Path = field(default_factory=default_state_dir)
    # None: a bootstrap node, which serves the runs in its store but trains nothing.
    run_id: str | None = None
    bootstrap: list[str] = field(default_factory=list)
    # Where `bootstrap` came from, named in logs and errors: "--bootstrap", "the ticket",
    # "PEERTRAIN_BOOTSTRAP", "the config file FILE".
    bootstrap_from: str = "--bootstrap"
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    # Addresses to advertise before the listen addresses (a public IP, a port forward);
    # without /p2p/: the node appends its id.
    announce: list[str] = field(default_factory=list)
    # Advertise on, and look for peers through, mDNS on the listen interfaces.
    mdns: bool = True
    # How long a joiner with no other bootstrap source waits for a first mDNS answer.
    mdns_wait_s: float = 2.0
    device: str = "auto"
    # The shortest heartbeat interval (a small run's); a run of N beats every
    # max(heartbeat_s, N / heartbeat_target_per_s) so each node receives at most about
    # heartbeat_target_per_s heartbeats a second (protocols/heartbeat.py, docs/membership.md).
    heartbeat_s: float = 1.0
    heartbeat_target_per_s: float = 50.0
    # A peer silent this long has left our view; a SIGKILLed peer disappears within it.
    peer_ttl_s: float = 5.0
    # How long `node join` looks for the run's providers before giving up.
    join_timeout_s: float = 30.0
    reprovide_s: float = 30.0
    # Run members the redialer keeps connected (more are accepted, up to max_peers; past
    # that the oldest unprotected ones are closed; a bootstrap closes none):
    # node/membership/redial.py.
    want_peers: int = 8
    max_peers: int = 32
    # A departed peer's run-document entries, and tombstones, are compacted this long after
    # their newest stamp (protocols/rundoc.py `compactable`; docs/rundoc.md "GC horizon").
    rundoc_horizon_s: float = 3600.0
    train: bool = True
    # Local training data (text or JSONL files) replacing the manifest's data source on
    # this node: data stays where it is, each peer may train on its own shard.
    data: list[str] = field(default_factory=list)
    # Testnet attack scenarios only: train on poisoned data, keep the poisoned model, send it
    # to every neighbour ("label-flip" | "backdoor"; None = an honest node). docs/robustness.md
    attack: str | None = None
    # Testnets and tests only: exchange with exactly these peers (peer ids, those of them
    # that are live) every round, instead of the run's pairing or random gossip neighbours.
    # Makes a scenario's topology deterministic (which honest node meets which sybils).
    # Every listed peer must list us too: the responder refuses anyone not in its list.
    neighbours: list[str] = field(default_factory=list)
    # What this node gives each peer and all of them (streams, buffered bytes, connections
    # per IP), and how misbehaviour is scored and banned: docs/robustness.md lists both.
    # An unreachable node asks its LAN's UPnP gateway for a port mapping (node/reach/).
    upnp: bool = True
    # A peer reached only through a relay is upgraded to a direct connection by a DCUtR
    # hole punch (node/reach/punch.py): driven, and answered. Off: the relay (or WebRTC).
    punch: bool = True
    budget: BudgetLimits = field(default_factory=BudgetLimits)
    scoring: ScoreSettings = field(default_factory=ScoreSettings)
    # The metrics port (Prometheus /metrics, the status page): (host, port), or None for
    # none (--no-metrics). metrics_fallback: the address is the default, not one asked
    # for, so a taken port means "any free port" (a second node on this machine), not an
    # error. node/metrics/service.py.
    metrics: tuple[str, int] | None = ("127.0.0.1", 9470)
    metrics_fallback: bool = True
    # Seconds between the progress lines a training node prints (step, losses, peers).
    progress_s: float = 30.0

    @property
    def role(self) -> str:
        return "bootstrap" if self.run_id is None else "node"
