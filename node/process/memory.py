"""Allocator tuning for a process that moves large tensors.

glibc serves every allocation above its mmap threshold (128 KiB, adapting up to 32 MiB)
with a fresh mmap, so each 4 MiB frame buffer, decrypted record or decoded chunk costs
page faults on first touch: the wire decoder measured ~1.5 GB/s into fresh buffers against
~8 GB/s into reused ones (docs/wire.md). Raising the mmap and trim thresholds lets
malloc reuse freed heap memory instead. The price: freed memory stays in the process (up
to the trim threshold) rather than going back to the OS at once, which suits a daemon
that exchanges the same sizes every round.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def tune_malloc(mmap_threshold: int = 64 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Apply the thresholds if this is glibc; False (and nothing changed) elsewhere."""
    # The process's own symbols first: find_library runs `ldconfig -p` in a subprocess,
    # 0.75 s of a joiner's start on the loaded 2-core machine (py-spy).
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        try:
            mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
        except (OSError, AttributeError):
            return False
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    if not ok:
        log.debug("mallopt refused the thresholds")
    return ok
