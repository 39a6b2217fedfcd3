"""Pipeline stages, pure torch with no networking: cutting the GPT, routing, execution.

docs/pipeline.md describes the layout and the routing; node/pipe/ runs them live.
The names below load on first use: `node.ml.pipeline.schedule` is torch-free, and the live
service's trio thread imports it to route before torch is loaded (node/process/preload.py).
"""

from importlib import import_module
from typing import Any

_WHERE = {
    "Pipeline": "runner", "PipelineFull": "runner", "StageOptim": "runner",
    "StageRunner": "runner", "Stage": "stages", "build_stages": "stages",
    "split_gpt": "stages", "execution_order": "schedule", "hops": "schedule",
    "micro_batches": "schedule", "path": "schedule", "route": "schedule",
    "route_back": "schedule", "swap_pairs": "schedule", "swap_partner": "schedule",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'node.ml.pipeline' has no attribute {name!r}")
    return getattr(import_module(f"node.ml.pipeline.{_WHERE[name]}"), name)
