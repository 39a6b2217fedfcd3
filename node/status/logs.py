"""Structured logs: JSON lines in the state directory, short human lines on stderr.

The JSON file is what `node testnet logs` and tools read; stderr is for a person watching
`node join`. Both get the same records.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path

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
        doc.update({k: v for k, v in vars(record).items() if k not in _STD_ATTRS})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class HumanFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        return f"{stamp} {record.levelname[0]} {record.name}: {record.getMessage()}"


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
        root.addHandler(err)
    if state_dir is not None:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        file = logging.handlers.RotatingFileHandler(
            Path(state_dir) / LOG_FILE, maxBytes=20 * 2**20, backupCount=2
        )
        file.setFormatter(JsonFormatter())
        file.setLevel(min(numeric, logging.INFO))
        root.addHandler(file)
    # py-libp2p logs every hiccup of every peer at WARNING; keep ours readable.
    logging.getLogger("libp2p").setLevel(logging.ERROR)
    logging.getLogger("multiaddr").setLevel(logging.ERROR)
