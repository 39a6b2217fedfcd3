"""Pipeline stages, pure torch with no networking: cutting the GPT, routing, execution.

docs/pipeline.md describes the layout and the routing; node/pipe/ runs them live.
"""

from node.pipeline.runner import Pipeline, PipelineFull, StageOptim, StageRunner
from node.pipeline.schedule import (
    execution_order,
    micro_batches,
    path,
    route,
    route_back,
    swap_pairs,
    swap_partner,
)
from node.pipeline.stages import Stage, build_stages, split_gpt

__all__ = [
    "Pipeline", "PipelineFull", "Stage", "StageOptim", "StageRunner", "build_stages",
    "execution_order", "micro_batches", "path", "route", "route_back", "split_gpt",
    "swap_pairs", "swap_partner",
]
