"""Up-front checks of flag values: each bad value is one `error:` line and exit 2, before
anything starts or anything is written."""

from __future__ import annotations

import math
from pathlib import Path

from cli.common import fail

LOG_LEVELS = ("debug", "info", "warning", "error")


def positive_seconds(flag: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise fail(f"{flag} {value:g}: expected a number of seconds greater than 0", 2)
    return value


def heartbeat_target(value: float) -> float:
    """--heartbeat-target (`node join`, `node testnet up`), or one error."""
    if not (math.isfinite(value) and 0 < value <= 100_000):
        raise fail(f"--heartbeat-target {value:g}: expected heartbeats a second "
                   "in (0, 100000]", 2)
    return value


def scale(heartbeat_target_per_s: float, want_peers: int, max_peers: int,
          rundoc_horizon: float) -> dict:
    """The scale flags (docs/operator.md "Large runs") as NodeConfig fields, or one error."""
    heartbeat_target(heartbeat_target_per_s)
    if not 0 <= want_peers <= 100_000:
        raise fail(f"--want-peers {want_peers}: expected 0 to 100000 connections", 2)
    if not want_peers <= max_peers <= 100_000 or max_peers < 1:
        raise fail(f"--max-peers {max_peers}: expected at least --want-peers ({want_peers}) "
                   "and 1, at most 100000", 2)
    if not (math.isfinite(rundoc_horizon) and 0 < rundoc_horizon <= 365 * 86400):
        raise fail(f"--rundoc-horizon {rundoc_horizon:g}: expected seconds in (0, 31536000]",
                   2)
    return {"heartbeat_target_per_s": heartbeat_target_per_s, "want_peers": want_peers,
            "max_peers": max_peers, "rundoc_horizon_s": rundoc_horizon}


def listen_addrs(values: list[str] | None) -> list[str]:
    """Each --listen must be /ip4/ADDR/tcp/PORT or /ip6/ADDR/tcp/PORT (PORT 0: any)."""
    import multiaddr

    addrs = list(values or ["/ip4/0.0.0.0/tcp/0"])
    for a in addrs:
        try:
            protocols = [p.name for p in multiaddr.Multiaddr(a).protocols()]
        except Exception as e:  # py-multiaddr raises a zoo of types for bad strings
            why = str(e).split("': ", 1)[-1].split(" (string:", 1)[0]
            raise fail(f"--listen {a}: not a multiaddr ({why}); expected e.g. "
                       "/ip4/0.0.0.0/tcp/4001", 2) from None
        if protocols != ["ip4", "tcp"] and protocols != ["ip6", "tcp"]:
            raise fail(f"--listen {a}: expected /ip4/ADDR/tcp/PORT or /ip6/ADDR/tcp/PORT, "
                       "e.g. /ip4/0.0.0.0/tcp/4001", 2)
        _try_bind(a, multiaddr.Multiaddr(a))
    return addrs


def _try_bind(text: str, ma) -> None:
    """py-libp2p only logs a listener that fails, and the node would run listening on
    nothing: try the address first (not this machine's, or the port is taken)."""
    import socket

    family = socket.AF_INET if ma.protocols()[0].name == "ip4" else socket.AF_INET6
    host = ma.value_for_protocol(ma.protocols()[0].code)
    port = int(ma.value_for_protocol(ma.protocols()[1].code))
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the node's listener
        try:
            s.bind((host, port))
        except OSError as e:
            raise fail(f"--listen {text}: cannot listen there: {e.strerror or e}", 2) from None


def log_level(value: str) -> str:
    if value.lower() not in LOG_LEVELS:
        raise fail(f"--log-level {value}: expected one of {', '.join(LOG_LEVELS)}", 2)
    return value.lower()


def device(value: str) -> str:
    """A misspelled device is exit 2; `cuda` on a machine that certainly has none is exit 10,
    before the node dials anyone (node/ml/device.py: without importing torch)."""
    from node.errors import DeviceUnavailable
    from node.ml import device as dev

    try:
        spec = dev.parse(value)
    except dev.DeviceError as e:
        raise fail(f"--device {value}: {e}", 2) from None
    try:
        dev.precheck(spec)
    except dev.DeviceError as e:
        raise fail(f"--device {value}: {e}", DeviceUnavailable.exit_code) from None
    return spec


def manifest_file(path: Path):  # -> protocols.manifest.Manifest
    """Load and validate a manifest file; a missing or invalid file is exit 2."""
    from protocols import manifest as mf

    try:
        return mf.load_manifest_file(path)
    except mf.ManifestError as e:
        raise fail(str(e), 2) from None
    except OSError as e:
        raise fail(f"cannot read {path}: {e.strerror or e}", 2) from None


def metrics_addr(value: str | None, off: bool) -> dict:
    """--metrics HOST:PORT / --no-metrics as NodeConfig fields. An address asked for must
    be free now (exit 2 here, before anything starts); the default falls back to a free
    port when taken (node/metrics/service.py)."""
    import socket

    from node.metrics.service import DEFAULT_HOST, DEFAULT_PORT, parse_address

    if off:
        if value is not None:
            raise fail("--metrics and --no-metrics: pass one of them", 2)
        return {"metrics": None, "metrics_fallback": False}
    if value is None:
        return {"metrics": (DEFAULT_HOST, DEFAULT_PORT), "metrics_fallback": True}
    try:
        host, port = parse_address(value)
    except ValueError as e:
        raise fail(f"--metrics {value}: {e}", 2) from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr)
    except OSError as e:
        raise fail(f"--metrics {value}: cannot listen there: {e.strerror or e}", 2) from None
    return {"metrics": (host, port), "metrics_fallback": False}
