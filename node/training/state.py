"""A training state (nested dicts and lists of tensors and plain values, as the trainer's
and the optimizers' `state_dict()` return) as one flat name -> tensor map, and back.

safetensors stores flat tensors only. Every tensor keeps its path as its name
("trainer/model/blocks.0.attn.weight"); the structure and the plain values go, as JSON,
into one uint8 tensor named `SKELETON`. Tensors that are one tensor (a tied embedding)
are stored once, as safetensors requires. Dict keys keep their type (torch's optimizer state
is keyed by parameter index, an int), so `from_tensors(to_tensors(s))` equals `s`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when a checkpoint is written: the daemon imports
    import torch  # this module before torch is loaded (in a worker thread)

    from node.ml.types import LocalTrainer, OuterOptimizer

SKELETON = "__state__"


def to_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    import torch

    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}  # a tied weight (wte = lm_head) is stored once

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = (value.device, value.dtype, value.untyped_storage().data_ptr(),
                   value.storage_offset(), tuple(value.shape), value.stride())
            if key not in seen:
                seen[key] = path
                tensors[path] = value.detach().cpu().contiguous()
            return {"t": seen[key]}
        if isinstance(value, dict):
            return {"d": [[k, walk(v, f"{path}/{k}")] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            return {"l": [walk(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if value is None or isinstance(value, bool | int | float | str):
            return {"v": value}
        raise TypeError(f"{path}: cannot store a {type(value).__name__} in a checkpoint")

    skeleton = json.dumps(walk(state, "")).encode()
    tensors[SKELETON] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
    return tensors


def from_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Inverse of `to_tensors`; KeyError or ValueError for a map it did not write."""
    skeleton = json.loads(bytes(tensors[SKELETON].numpy()))

    def build(node: dict[str, Any]) -> Any:
        if "t" in node:
            return tensors[node["t"]]
        if "d" in node:
            return {k: build(v) for k, v in node["d"]}
        if "l" in node:
            return [build(v) for v in node["l"]]
        return node["v"]

    return build(skeleton)


def checkpoint_tensors(trainer: LocalTrainer,
                       outer: OuterOptimizer | None) -> dict[str, torch.Tensor]:
    """The trainer's and the outer optimizer's `state_dict()`, as safetensors wants them."""
    state = {"trainer": trainer.state_dict()}
    # NoLoCo's momentum; gossip learning keeps none
    if outer is not None and hasattr(outer, "state_dict"):
        state["outer"] = outer.state_dict()
    return to_tensors(state)


def restore_checkpoint(trainer: LocalTrainer, outer: OuterOptimizer | None,
                       tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `checkpoint_tensors`, through the same `load_state_dict`s."""
    state = from_tensors(tensors)
    trainer.load_state_dict(state["trainer"])
    if outer is not None and hasattr(outer, "load_state_dict") and "outer" in state:
        outer.load_state_dict(state["outer"])
