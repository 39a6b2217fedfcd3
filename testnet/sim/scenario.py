"""Simulator scenarios: a seeded TOML file, every key typed, defaulted and range-checked.

A scenario says how big the swarm is, how it trains, how its membership gossips, what its
network looks like and how it churns. Unknown sections or keys, wrong types and values out
of range raise ScenarioError naming the file, the key and what was expected, so a typo
never silently becomes a default. testnet/sim/scenarios/default.toml lists every key
with its default and why; docs/simulator.md documents the format.
"""

from __future__ import annotations

import importlib
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

SCHEMA = 1
NAT_KINDS = ("public", "fullcone", "home", "symmetric")
PROVISIONS = ("newest", "holders")
SHAPES = ("info", "fields")  # membership.announce_shape


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message names the file and the key."""


@dataclass(frozen=True)
class Training:
    algorithm: str = "noloco"  # "noloco" | "diloco"
    inner_steps: int = 20  # H: inner steps per outer round
    step_s: float = 0.5  # virtual seconds of compute per inner step (median peer)
    step_jitter: float = 0.1  # sd of log(step time) between peers and rounds
    group_size: int = 2  # NoLoCo's group size (node/ml/optim/pairing.py)
    dim: int = 32  # parameters of the quadratic model each peer trains
    lr: float = 0.05  # inner SGD learning rate
    noise: float = 1.0  # sd of the inner gradients' noise
    heterogeneity: float = 1.0  # sd of each peer's optimum around the shared one
    model_mb: float = 100.0  # bytes a weight exchange carries on the wire (fp32 of the real model)


@dataclass(frozen=True)
class Membership:
    heartbeat_s: float = 1.0  # node/config.py
    # How the heartbeat interval follows the live count: "constant" (today: heartbeat_s
    # whatever N), or "module:function" naming a pure function (n_live, heartbeat_s) ->
    # seconds, e.g. the rate policy the real node will use (docs/simulator.md).
    policy: str = "constant"
    ttl_s: float = 5.0  # peer_ttl_s: a silent peer leaves the view
    announce_s: float = 2.0  # run-document own entries re-announced (node/run/rundoc_sync.py)
    anti_entropy_s: float = 10.0  # run-document anti-entropy with a random live peer
    reprovide_s: float = 30.0  # DHT re-provide of the run key (node/config.py)
    want_peers: int = 8  # redialer: dial members while below this many connections
    # The run document's announce interval: "constant" (every announce_s whatever N, as
    # before issue 30) or "module:function" (n_live, announce_s) -> seconds, e.g.
    # "testnet.sim.policies:announce" (the node's RunDocSync.announce_interval_s).
    announce_policy: str = "constant"
    # Compaction of departed peers' keys (protocols.rundoc.compactable) with the node's
    # horizon rule (RunDocSync.horizon_ms: this, never under 10 announce intervals);
    # 0: never compacted (before issue 30).
    gc_horizon_s: float = 0.0
    # The connection bound (node/membership/redial.py plan_connections: dial up to
    # want_peers, close past max_peers), which sets IHAVE's targets; 0: the old model's
    # fixed 2 x want_peers connections.
    max_peers: int = 0
    # Who re-provides the run key each reprovide_s: 0, every member (before issue 30); k,
    # the node's rendezvous sample of k members (node/run/providers.py), joiners once.
    providers: int = 0
    # A peer's own run-document entries: "info" (the node's: info + last_seen, 3 kept with
    # a checkpoint) or "fields" (before issue 30: a key per field, 6 kept).
    announce_shape: str = "info"


@dataclass(frozen=True)
class Gossip:
    degree: int = 6  # gossipsub D (p2p/host.py GossipSettings)
    lazy_min: int = 6  # IHAVE targets per gossipsub heartbeat: max(lazy_min, 0.25 x non-mesh)
    window: int = 3  # gossipsub heartbeats of message ids in each IHAVE (py-libp2p's default)
    heartbeat_s: float = 1.0  # gossipsub's own heartbeat (p2p/host.py)
    idontwant_min_bytes: int = 1024  # p2p/gossipsub.py
    floods: int = 8  # floods traced per swarm size to measure copies and spread


@dataclass(frozen=True)
class Network:
    latency_ms: tuple[float, float] = (10.0, 150.0)  # one-way, per peer, uniform
    bandwidth_mbit: tuple[float, float] = (20.0, 1000.0)  # per-peer link, log-uniform
    relay_mbit: float = 10.0  # what a relayed path carries (circuit relay v2's limits)
    nat: dict[str, float] = field(default_factory=lambda: {
        "public": 0.2, "fullcone": 0.2, "home": 0.4, "symmetric": 0.2})


@dataclass(frozen=True)
class Churn:
    per_hour: float = 0.0  # expected leaves per peer per hour (Poisson); joins keep N level
    crash_share: float = 0.5  # of leaves, the share that are crashes (no goodbye)


@dataclass(frozen=True)
class Checkpoint:
    size_mb: float = 100.0  # one checkpoint's bytes
    every_rounds: int = 5  # each trainer writes one every this many outer rounds
    # Who serves a burst of joiners (testnet/sim/experiments.py checkpoint_burst):
    # "newest" (its writer alone, before issue 30) or "holders" (every peer that pulled
    # it, chosen by node.checkpoints.holders.choose_holders, UploadSlots per holder).
    provision: str = "newest"


@dataclass(frozen=True)
class Scenario:
    seed: int = 0
    peers: int = 100  # live at the start; churn keeps the mean there
    rounds: int = 20  # outer rounds simulated
    training: Training = field(default_factory=Training)
    membership: Membership = field(default_factory=Membership)
    gossip: Gossip = field(default_factory=Gossip)
    network: Network = field(default_factory=Network)
    churn: Churn = field(default_factory=Churn)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)

    def with_(self, **changes: Any) -> Scenario:
        """A copy with top-level fields or `section__key` fields changed."""
        top = {k: v for k, v in changes.items() if "__" not in k}
        out = replace(self, **top)
        for k, v in changes.items():
            if "__" in k:
                section, key = k.split("__", 1)
                out = replace(out, **{section: replace(getattr(out, section), **{key: v})})
        return out

    def interval_policy(self) -> Callable[[int, float], float]:
        return load_policy(self.membership.policy)

    def announce_policy(self) -> Callable[[int, float], float]:
        return load_policy(self.membership.announce_policy)


_SECTIONS = {"training": Training, "membership": Membership, "gossip": Gossip,
             "network": Network, "churn": Churn, "checkpoint": Checkpoint}
_RANGES: dict[str, tuple[float, float]] = {
    "peers": (2, 1_000_000), "rounds": (1, 100_000), "inner_steps": (1, 100_000),
    "step_s": (1e-3, 1e5), "step_jitter": (0, 2), "group_size": (1, 64), "dim": (1, 4096),
    "lr": (1e-6, 1.0), "noise": (0, 100), "heterogeneity": (0, 100), "model_mb": (1e-3, 1e5),
    "heartbeat_s": (0.01, 3600), "ttl_s": (0.1, 3600), "announce_s": (0.1, 3600),
    "anti_entropy_s": (0.1, 3600), "reprovide_s": (1, 86400), "want_peers": (1, 10_000),
    "degree": (1, 100), "lazy_min": (0, 100), "window": (1, 100), "floods": (1, 1000),
    "idontwant_min_bytes": (0, 1 << 30), "relay_mbit": (0.01, 1e5), "per_hour": (0, 100),
    "crash_share": (0, 1), "size_mb": (1e-3, 1e6), "every_rounds": (1, 100_000),
    "seed": (0, 2**63 - 1), "gc_horizon_s": (0, 1e7), "max_peers": (0, 100_000),
    "providers": (0, 100_000),
}


def _err(path: str, key: str, msg: str) -> ScenarioError:
    return ScenarioError(f"scenario {path}: {key}: {msg}")


def _check_value(path: str, where: str, name: str, default: Any, value: Any) -> Any:
    """`value` coerced to the type of `default`, or ScenarioError saying what was expected."""
    key = f"{where}{name}"
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok = isinstance(value, str)
    elif isinstance(default, tuple):
        ok = (isinstance(value, list) and len(value) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
              and 0 <= value[0] <= value[1])
        if not ok:
            raise _err(path, key, f"expected [low, high] with 0 <= low <= high, got {value!r}")
        return (float(value[0]), float(value[1]))
    elif isinstance(default, dict):
        if not isinstance(value, dict) or not value:
            raise _err(path, key, f"expected a table of shares, got {value!r}")
        unknown = sorted(set(value) - set(NAT_KINDS))
        if unknown:
            raise _err(path, key, f"unknown NAT kind {unknown[0]!r}; known: {', '.join(NAT_KINDS)}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                   for v in value.values()) or sum(value.values()) <= 0:
            raise _err(path, key, "shares must be non-negative numbers, not all zero")
        total = float(sum(value.values()))
        return {k: float(value.get(k, 0.0)) / total for k in NAT_KINDS}
    else:  # pragma: no cover - every field's default is one of the above
        raise TypeError(f"{key}: unsupported default {default!r}")
    if not ok:
        raise _err(path, key, f"expected {type(default).__name__}, got {value!r}")
    if name in _RANGES:
        low, high = _RANGES[name]
        if not low <= value <= high:
            raise _err(path, key, f"{value} is out of range [{low:g}, {high:g}]")
    return value


def _build(cls: type, table: dict, path: str, where: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    defaults = cls()
    kwargs = {}
    for name, value in table.items():
        if name not in known or (name in _SECTIONS and where == ""):
            if name in _SECTIONS and where == "":
                continue
            raise _err(path, f"{where}{name}",
                       f"unknown key; known: {', '.join(k for k in known if k not in _SECTIONS)}")
        kwargs[name] = _check_value(path, where, name, getattr(defaults, name), value)
    return cls(**kwargs)


def parse(text: str, path: str = "<string>") -> Scenario:
    """A Scenario from TOML text; ScenarioError says what is wrong and where."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"scenario {path}: not valid TOML: {e}") from None
    schema = doc.pop("schema", None)
    if schema != SCHEMA:
        raise _err(path, "schema", f"expected {SCHEMA}, got {schema!r}")
    sections = {}
    for name, value in doc.items():
        if name in _SECTIONS:
            if not isinstance(value, dict):
                raise _err(path, f"[{name}]", "expected a table")
            sections[name] = _build(_SECTIONS[name], value, path, f"{name}.")
    top = {k: v for k, v in doc.items() if k not in _SECTIONS}
    scenario = _build(Scenario, top, path, "")
    scenario = replace(scenario, **sections)
    t = scenario.training
    if t.algorithm not in ("noloco", "diloco"):
        raise _err(path, "training.algorithm",
                   f"expected 'noloco' or 'diloco', got {t.algorithm!r}")
    for key, check in (("policy", scenario.interval_policy),
                       ("announce_policy", scenario.announce_policy)):
        try:
            check()
        except ScenarioError as e:
            raise _err(path, f"membership.{key}", str(e)) from None
    m = scenario.membership
    if m.max_peers and m.max_peers < m.want_peers:
        raise _err(path, "membership.max_peers",
                   f"{m.max_peers} is under want_peers ({m.want_peers}); 0 for the old model")
    if m.announce_shape not in SHAPES:
        raise _err(path, "membership.announce_shape",
                   f"expected one of {', '.join(SHAPES)}, got {m.announce_shape!r}")
    if (prov := scenario.checkpoint.provision) not in PROVISIONS:
        raise _err(path, "checkpoint.provision",
                   f"expected one of {', '.join(PROVISIONS)}, got {prov!r}")
    return scenario


def load(path: str | Path) -> Scenario:
    """Read and check a scenario file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ScenarioError(f"scenario {p}: cannot read: {e.strerror or e}") from None
    return parse(text, str(p))


def constant_interval(n_live: int, heartbeat_s: float) -> float:
    """The policy before issue 30: every node beats (or announces) every base interval,
    whatever the swarm's size (the node's now stretches it: testnet/sim/policies.py)."""
    return heartbeat_s


def load_policy(spec: str) -> Callable[[int, float], float]:
    """The interval policy (heartbeat or announce) named by `spec`: "constant", or
    "module:function" for a pure function (n_live, base_s) -> seconds (checked on a few
    sizes)."""
    if spec == "constant":
        return constant_interval
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ScenarioError(f"expected 'constant' or 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ScenarioError(f"cannot load {spec!r}: {e}") from None
    for n in (1, 10, 10_000):
        try:
            v = fn(n, 1.0)
        except Exception as e:
            raise ScenarioError(f"{spec}({n}, 1.0) raised {e!r}") from None
        if not isinstance(v, (int, float)) or not v > 0:
            raise ScenarioError(f"{spec}({n}, 1.0) returned {v!r}, expected seconds > 0")
    return fn
