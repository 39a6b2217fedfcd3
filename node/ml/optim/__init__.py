"""Outer optimizers over flat fp32 parameter vectors: NoLoCo, DiLoCo, and NoLoCo's pairing.

Pure tensor code with no networking: the caller moves the vectors between peers, and the
simulator and tests call these directly. Vectors are laid out as
`node.ml.trainer.Trainer.parameters_vector()`. See docs/training.md for the update rules.
"""

from .diloco import DiLoCo, DiLoCoConfig, diloco_update
from .noloco import NoLoCo, NoLoCoConfig, noloco_update
from .pairing import group_of, neighbours_of, noloco_groups, partner_of, permutation

__all__ = [
    "DiLoCo",
    "DiLoCoConfig",
    "NoLoCo",
    "NoLoCoConfig",
    "diloco_update",
    "group_of",
    "neighbours_of",
    "noloco_groups",
    "noloco_update",
    "partner_of",
    "permutation",
]
