"""Recovering lost pipeline stages without checkpoints: CheckFree and CheckFree+.

Pure functions over state dicts (node/ml/recovery/checkfree.py); docs/pipeline.md.
"""

from node.ml.recovery.checkfree import (
    DEFAULT_LR_BOOST,
    BadGradNorm,
    EdgeCopies,
    Plan,
    RecoveryError,
    check_grad_norm,
    checkfree_average,
    checkfree_weights,
    neighbour_average,
    plan,
    rebuild_blocks,
)

__all__ = [
    "DEFAULT_LR_BOOST", "BadGradNorm", "EdgeCopies", "Plan", "RecoveryError",
    "check_grad_norm", "checkfree_average", "checkfree_weights", "neighbour_average", "plan",
    "rebuild_blocks",
]
