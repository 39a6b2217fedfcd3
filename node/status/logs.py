"""Structured logs: JSON lines in the state directory, short human lines on stderr.

The JSON file is what `node testnet logs` and tools read; stderr is for a person watching
`node join`. Both get the same records.

Records about a peer's misbehaviour carry `extra={"peer": ..., "reason": ...}`; the
`PeerFlood` filter on both handlers lets the first `burst` of each (peer, reason) through
per `window_s` and summarizes the rest ("... 612 more from 12D3... (reason) in 60 s"):
before it, one hostile peer wrote 822 WARNING lines in two minutes. py-libp2p's records
carry neither, so their key is read from the text (`third_party_key`). The totals are
counters in `node status` (the guard service).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import re
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

LOG_FILE = "node.log"

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # `log.info("...", extra={"peer": p})` fields become top-level keys.
        doc.update({k: v for k, v in vars(record).items()
                    if k not in _STD_ATTRS and not k.startswith("_")})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class HumanFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        return f"{stamp} {record.levelname[0]} {record.name}: {record.getMessage()}"


class PeerFlood(logging.Filter):
    """Rate-limits log records per (peer, reason): `burst` per `window_s`, then a summary.

    Time is each record's own `created`, so tests pass records with chosen times. One
    instance serves every handler (a record's fate is decided once and remembered on it).
    At most `max_keys` windows are tracked; the oldest are summarized to make room.
    """

    def __init__(self, burst: int = 3, window_s: float = 60.0, max_keys: int = 1024) -> None:
        super().__init__()
        self.burst, self.window_s, self.max_keys = burst, window_s, max_keys
        self._windows: dict[tuple[str, str], list[Any]] = {}  # key -> [start, seen, record]
        self.suppressed: Counter[str] = Counter()  # reason -> records not written

    def filter(self, record: logging.LogRecord) -> bool:
        decided = getattr(record, "_flood_pass", None)
        if decided is not None:
            return decided
        peer, reason = getattr(record, "peer", None), getattr(record, "reason", None)
        keep = True
        if peer is not None and reason is not None:
            keep = self._count((str(peer), str(reason)), record, str(reason))
        elif record.name.startswith(THIRD_PARTY) and record.levelno >= logging.WARNING \
                and not (isinstance(record.msg, str) and record.msg in ROUTINE_ERRORS):
            keep = self._count(third_party_key(record), record, record.name.split(".")[0])
        record._flood_pass = keep
        return keep

    def _count(self, key: tuple[str, str], record: logging.LogRecord, label: str) -> bool:
        window = self._windows.get(key)
        if window is not None and record.created - window[0] >= self.window_s:
            self._summarize(key)
            window = None
        if window is None:
            if len(self._windows) >= self.max_keys:
                self._summarize(min(self._windows, key=lambda k: self._windows[k][0]))
            window = self._windows[key] = [record.created, 0, record]
        window[1] += 1
        window[2] = record
        if window[1] <= self.burst:
            return True
        self.suppressed[label] += 1  # a metric label: a reason, or the library's name
        return False

    def flush(self, now: float | None = None) -> None:
        """Summarize every window that has ended (all of them with now=None)."""
        for key in [k for k, w in self._windows.items()
                    if now is None or now - w[0] >= self.window_s]:
            self._summarize(key)

    def _summarize(self, key: tuple[str, str]) -> None:
        _start, seen, last = self._windows.pop(key)
        more = seen - self.burst
        if more <= 0:
            return
        peer, reason = key
        summary = logging.LogRecord(
            last.name, last.levelno, last.pathname, last.lineno,
            "... %d more from %s (%s) in %.0f s", (more, peer, reason, self.window_s), None)
        summary.peer, summary.suppressed = peer, more
        summary._flood_pass = True
        logging.getLogger(last.name).handle(summary)

    def statistics(self) -> dict[str, Any]:
        return {"suppressed": dict(self.suppressed), "open_windows": len(self._windows)}


_PEER_ID = re.compile(r"\b(?:12D3Koo[1-9A-HJ-NP-Za-km-z]{45}|Qm[1-9A-HJ-NP-Za-km-z]{44})\b")
_VARYING = re.compile(r"(/ip[46]/\S+|\b\d+(?:\.\d+){3}(?::\d+)?\b|0x[0-9a-f]+|\d+)")


def third_party_key(record: logging.LogRecord) -> tuple[str, str]:
    """(peer, reason) for a py-libp2p record, which carries neither: the first peer id in
    its text (else the logger), and its message with peer ids, addresses and numbers
    blanked, so that "protocols not supported" for one peer on 40 streams is one key.
    Without it, 14-62 such ERRORs per node per run went past the per-peer limits."""
    text = record.getMessage()
    found = _PEER_ID.search(text)
    shape = record.msg if isinstance(record.msg, str) and record.args else text
    shape = _VARYING.sub("#", _PEER_ID.sub("<peer>", str(shape)))[:120]
    return (found.group(0) if found else record.name), f"{record.name}: {shape}"


#: The process's one flood filter (logging is process-wide), installed by setup_logging.
FLOOD = PeerFlood()


class RecentProblems(logging.Handler):
    """The last `capacity` WARNING and ERROR records, for the status page's problems panel
    (a person at the page saw no error unless they read the log). After the flood filter:
    a flood is its burst and its summary here too."""

    def __init__(self, capacity: int = 20) -> None:
        super().__init__(logging.WARNING)
        self.records: deque[dict[str, Any]] = deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a record whose arguments do not format: its template
            msg = str(record.msg)
        self.records.append({"ts": round(record.created, 3), "level": record.levelname.lower(),
                             "logger": record.name, "msg": msg[:500]})

    def recent(self) -> list[dict[str, Any]]:
        return list(self.records)


#: The process's recent problems (installed by setup_logging; read by the status page).
RECENT = RecentProblems()


THIRD_PARTY = ("libp2p", "multiaddr")  # loggers whose records go to node.log only
# py-libp2p's ERRORs that are routine, kept out of node.log: a connection that ends before
# its muxer is chosen (every AutoNAT dial-back ends so: Substrate.probe closes once the
# Noise handshake has proved the key; so does the losing half of a simultaneous dial), and
# a dial to a peer that is gone (the DHT and the redialer try peers that left, until they
# are forgotten; the callers log their own failures, with what they were for): 208 of
# the 221 ERRORs in the 8 node.logs of a `node bench join` testnet (2026-11-27).
ROUTINE_ERRORS = frozenset({"fail to upgrade mux for peer %s",
                            "Failed to open TCP stream: %s"})


def setup_logging(state_dir: Path | None, level: str = "info", *, stderr: bool = True) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.DEBUG)
    numeric = getattr(logging, level.upper(), logging.INFO)
    if stderr:
        err = logging.StreamHandler(sys.stderr)
        err.setFormatter(HumanFormatter())
        err.setLevel(numeric)
        err.addFilter(FLOOD)
        # Records for the file only (`extra={"console": False}`: node.log's progress points).
        err.addFilter(lambda record: getattr(record, "console", True))
        err.addFilter(lambda record: not record.name.startswith(THIRD_PARTY))
        root.addHandler(err)
    if state_dir is not None:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        file = logging.handlers.RotatingFileHandler(
            Path(state_dir) / LOG_FILE, maxBytes=20 * 2**20, backupCount=2
        )
        file.setFormatter(JsonFormatter())
        file.setLevel(min(numeric, logging.INFO))
        # errors only: some of py-libp2p's loggers are set to INFO (its auto-connector's
        # "initiating 193 new dials" every 10 s)
        file.addFilter(lambda record: not record.name.startswith(THIRD_PARTY)
                       or (record.levelno >= logging.ERROR
                           and not (isinstance(record.msg, str)
                                    and record.msg in ROUTINE_ERRORS)))
        file.addFilter(FLOOD)
        root.addHandler(file)
    RECENT.filters = [FLOOD, lambda record: not record.name.startswith(THIRD_PARTY)]
    root.addHandler(RECENT)
    # py-libp2p logs every hiccup of every peer at WARNING, and at ERROR what is routine in
    # a swarm (a simultaneous dial's muxer upgrade, a peer without one of our protocols).
    # Its logger has no handler and does not propagate, so Python's last-resort handler
    # printed those errors raw on the terminal; they go to node.log now, the terminal
    # keeps ours.
    for name in THIRD_PARTY:
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        logger.propagate = True
